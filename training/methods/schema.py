"""The schema of a resolved preset: which keys exist, what each one means and which values are valid.

`config.resolve` checks every config against it after inheritance and `--set` overrides, so a bad value fails in
one line before anything starts, not three times in the workers. One model per section (`model`, `train`,
`eval`) and one params model per method (`METHOD_PARAMS`, by the method's registered name); `method` maps
method names to their params, so composed methods (`ctp_er`) are checked each by its own model. Fields are strict
(an integer is not "3", 2.5 or true; a number may be an integer; a boolean is true or false) and each field's
`description` is its meaning, quoted by the error lines.
"""

import difflib
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ModelSection(Section):
    arch: str = Field(min_length=1, description="open_clip architecture name: training/model_configs/*.json or "
                      "built-in")
    pretrained: Optional[str] = Field(min_length=1, description="a pretrained tag or a checkpoint path, used for the "
                                      "first task only, null = random weights")


class TrainSection(Section):
    epochs: int = Field(ge=1, description="passes over the task's data")
    micro_batch: int = Field(ge=1, description="image-text pairs per worker per step")
    grad_accum: int = Field(ge=1, description="micro batches per optimizer step")
    max_steps: int = Field(0, ge=0, description="steps per epoch at most (0: the whole task): a smoke run or a "
                           "benchmark caps it")
    lr: float = Field(gt=0, description="peak learning rate of AdamW")
    weight_decay: float = Field(ge=0, description="AdamW's decoupled weight decay")
    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(min_length=2, max_length=2,
                                                             description="AdamW's β1 and β2")
    eps: float = Field(gt=0, description="AdamW's ε")
    warmup_steps: int = Field(ge=0, description="linear warmup steps at the start of every task")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="linear warmup as a fraction of the task's optimizer "
                                "steps, or warmup_steps where that is more")
    min_lr_ratio: float = Field(ge=0, le=1, description="cosine floor, as a fraction of lr: warmup + cosine restart "
                                "every task")
    grad_clip: float = Field(ge=0, description="max gradient norm, 0 = off: open_clip's default")
    zero_stage: int = Field(ge=0, le=3, description="DeepSpeed ZeRO stage, 0-3 on CPU (gloo) and GPUs")
    precision: Literal["fp32", "bf16", "fp16"] = Field(description="fp32, or DeepSpeed's bf16/fp16 mixed precision")
    log_every: int = Field(ge=1, description="steps between metric reports")
    shuffle_buffer: int = Field(ge=0, description="rows in each worker's local shuffle buffer")
    data_cpus: float = Field(gt=0, description="CPUs each Ray Data read / preprocessing task reserves, < 1 where "
                             "nodes are small")
    on_bad_image: Literal["fail", "skip"] = Field(description="an unreadable image fails the job, or is skipped "
                                                  "and counted in the run's metrics")
    seed: int = Field(ge=0, description="seed of the initialisation, the shuffles and the crops")
    deterministic: bool = Field(description="true: a rerun gives the same weights: ordered input, each row's crop "
                                "fixed by seed and id")
    max_failures: int = Field(ge=0, description="worker-group restarts from the last epoch checkpoint")


class EvalSection(Section):
    batch_size: int = Field(ge=1, description="images or captions embedded per batch when evaluating")


# -- each method's params, by the name it is registered under (training/methods/__init__.py METHODS) ---------

class JointParams(Section):
    """Joint training has no params: `joint: {}`."""


class ImportanceParams(Section):  # EWC, MAS (training/methods/importance.py)
    weight: float = Field(ge=0, description="penalty = weight · Σ Ω (θ − θ*)², the pull toward the previous "
                          "task's weights")
    batches: Optional[int] = Field(None, ge=1, description="last-epoch batches whose gradients measure the "
                                   "importances, held until the task ends (null: all of them, one pass over the "
                                   "task as CTP's code measures)")


class LwFParams(Section):
    weight: float = Field(ge=0, description="scale of the distillation term")
    temperature: float = Field(gt=0, description="softmax temperature T of the distillation, ×T²")


class ERParams(Section):
    buffer_pairs: Optional[int] = Field(None, ge=0, description="image-text pairs kept over the whole stream, a "
                                        "reservoir sample (null: buffer_fraction sizes the buffer)")
    buffer_fraction: Optional[float] = Field(None, gt=0, le=1, description="share of the pairs seen so far that is "
                                             "kept, each with this probability (null: buffer_pairs sizes the buffer)")
    seed: int = Field(0, ge=0, description="seed of the buffer's sampling")

    @model_validator(mode="after")
    def _one_size(self):
        if (self.buffer_pairs is None) == (self.buffer_fraction is None):
            raise ValueError("give exactly one of buffer_pairs and buffer_fraction, the other null (e.g. --set "
                             "method.er.buffer_pairs=null with --set method.er.buffer_fraction=F)")
        return self


class ModXParams(Section):
    alpha: float = Field(ge=0, description="α, scale of the off-diagonal distillation term")
    mask_diagonal: bool = Field(False, description="the card's untested variant: renormalise without the positive "
                                "pair, which the paper keeps")


class CTPParams(Section):
    momentum: float = Field(ge=0, le=1, description="m of the compatible momentum model, θc ← m·θc + "
                            "(1−m)/2·(θ(t−1) + θt)")
    first_task_momentum: float = Field(ge=0, le=1, description="m of the first task's plain EMA, with no θ(t−1) yet")
    queue_size: int = Field(ge=1, description="K, momentum features queued per modality, best a multiple of the "
                            "global batch")
    tau: float = Field(gt=0, description="temperature τ of the momentum contrast and topology terms")
    cmc_weight: float = Field(ge=0, description="scale of L_cmc, the compatible momentum contrast")
    topology_weight: float = Field(ge=0, description="scale of the topology terms L_c and L_s")
    seed: int = Field(0, ge=0, description="seed of the queues' random start")


class CClipParams(Section):
    rank: int = Field(ge=1, description="LoRA rank r")
    alpha: float = Field(gt=0, description="LoRA alpha: the adapters' scale s = alpha / rank")
    dropout: float = Field(ge=0, lt=1, description="dropout on the adapters' input features")
    merge: float = Field(ge=0, description="α: W += α·s·B·A at task end, then the adapters are removed")
    targets: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, description="the weights that get "
                                                               "adapters, by name suffix, e.g. attn.in_proj_weight")
    embeddings: list[Annotated[str, Field(min_length=1)]] = Field(description="parameters trained in full beside "
                                                                  "the adapters, kept whole at the merge, by exact "
                                                                  "name, e.g. token_embedding.weight ([]: LoRA only)")
    ckc_weight: float = Field(ge=0, description="scale of the contrastive knowledge consolidation term")
    text_lr_scale: float = Field(ge=0, description="text tower LR = this × train.lr, its embeddings included")


class CllClipParams(Section):
    vocab_size: int = Field(ge=1, description="size of the BPE vocabulary trained on each language")
    teir_init: bool = Field(description="new rows from N(mean, std²) of the old table, else N(0, 0.02²)")
    teir_scale: bool = Field(description="λ-scaled gradients and decay, else λ ≡ 1")
    weight_decay: float = Field(ge=0, description="decoupled per-row weight decay of the token embeddings, scaled "
                                "by λ, 0 = none")
    cross_modal_weight: float = Field(ge=0, description="scale of L_cm, the CLIP loss")
    cross_lingual_weight: float = Field(ge=0, description="scale of L_cl, the distance to the English caption's "
                                        "feature, 0 = off")


METHOD_PARAMS: dict[str, type[Section]] = {
    "joint": JointParams, "ewc": ImportanceParams, "mas": ImportanceParams, "lwf": LwFParams, "er": ERParams,
    "modx": ModXParams, "ctp": CTPParams, "cclip": CClipParams, "cllclip": CllClipParams,
}


# what a method cannot run under, and why: {method: ({train key: the one value it runs with}, why)}
TRAIN_REQUIRES: dict[str, tuple[dict[str, Any], str]] = {
    "cllclip": ({"zero_stage": 0, "precision": "fp32"},
                "it scales rows of the fp32 token-embedding table after each step, which ZeRO 1-3 (partitioned "
                "weights and optimizer copies) and mixed precision (an fp32 master copy) overwrite"),
}


def refusals(config: dict) -> list[str]:
    """One line per method of a valid config that refuses its `train` settings, naming the method and why."""
    out = []
    for name in config.get("method") or {}:
        required, why = TRAIN_REQUIRES.get(name, ({}, ""))
        wrong = {k: config["train"][k] for k, v in required.items() if config["train"][k] != v}
        if wrong:
            out.append(f"method {name} runs with {_settings(required)} only (got {_settings(wrong)}): {why}")
    return out


def _settings(values: dict) -> str:
    return " ".join(f"train.{k}={v}" for k, v in values.items())


class _Methods(Section):
    """{method name: params}; a method written without params (`joint:`) has none given."""

    @model_validator(mode="before")
    @classmethod
    def _empty_params(cls, data: Any) -> Any:
        return {k: {} if v is None else v for k, v in data.items()} if isinstance(data, dict) else data


MethodSection = create_model("MethodSection", __base__=_Methods,
                             **{name: (Optional[params], None) for name, params in METHOD_PARAMS.items()})


class Config(Section):
    model: ModelSection
    train: TrainSection
    eval: EvalSection
    method: MethodSection = Field(default_factory=MethodSection, description="methods applied together, "
                                  "{name: params}, empty = sequential fine-tuning")
    preset: str

    @model_validator(mode="before")
    @classmethod
    def _no_methods(cls, data: Any) -> Any:
        return {**data, "method": {}} if isinstance(data, dict) and data.get("method", {}) is None else data


@dataclass(frozen=True)
class Problem:
    """One invalid value: where (`path`, cut at the field), and what is expected there (one line)."""

    path: tuple[str, ...]
    message: str  # no '; ': that separates the problems of one error
    missing: bool = False


def check(config: dict) -> tuple[dict, list[Problem]]:
    """(the config as validated: its keys and order, numbers made floats where the schema says so; problems),
    the config unchanged when there are problems."""
    try:
        valid = Config.model_validate(config)
    except ValidationError as exc:
        problems = list(dict.fromkeys(_problem(e) for e in exc.errors()))
        return config, _group_missing(problems)
    return _in_order(config, valid.model_dump(exclude_unset=True)), []


def _problem(error: dict) -> Problem:
    model: type[BaseModel] = Config
    path: list[str] = []
    info: Optional[FieldInfo] = None
    for part in error["loc"]:
        if not isinstance(part, str) or model is None:
            break  # a list item: the field's own text says what each item must be
        info = model.model_fields.get(part)
        path.append(part)
        if info is None:  # a key the section does not have
            return Problem(tuple(path), _unknown(model, part))
        model = _section(info.annotation)
    if error["type"] == "missing":
        return Problem(tuple(path), f"missing, expected {_describe(info)}", missing=True)
    if error["type"] == "value_error":  # a section's own check across its keys (ERParams: one buffer size)
        return Problem(tuple(path), str(error["ctx"]["error"]))
    return Problem(tuple(path), f"expected {_describe(info)}")


def _group_missing(problems: list[Problem]) -> list[Problem]:
    """Several keys missing from one section (a `--set train={...}` that left most out) as one problem."""
    missing: dict[tuple[str, ...], list[str]] = {}
    for p in problems:
        if p.missing:
            missing.setdefault(p.path[:-1], []).append(p.path[-1])
    out = []
    for p in problems:
        keys = missing.get(p.path[:-1], []) if p.missing else []
        if len(keys) < 2:
            out.append(p)
        elif p.path[-1] == keys[0]:
            out.append(Problem(p.path[:-1], f"missing {'sections ' if len(p.path) == 1 else ''}{', '.join(keys)}",
                               missing=True))
    return out


def _unknown(model: type[BaseModel], key: str) -> str:
    known = list(model.model_fields)
    if issubclass(model, _Methods):
        return f"unknown method, known: {', '.join(sorted(known))}"
    if not known:
        return "unknown key, it takes none"
    close = difflib.get_close_matches(key, known, n=1)
    return f"unknown key (did you mean {close[0]}?)" if close else f"unknown key, known: {', '.join(known)}"


def _section(annotation) -> Optional[type[BaseModel]]:
    """The model of a field that is a section (or an optional one), else None."""
    for tp in (annotation, *get_args(annotation)):
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
    return None


def _describe(info: Optional[FieldInfo]) -> str:
    if info is None:  # the whole config
        return "a mapping of sections"
    text = _kind(info.annotation, info.metadata)
    return f"{text} ({info.description})" if info.description else text


def _kind(tp, metadata: list, plural: bool = False) -> str:
    """What values of type `tp` with constraints `metadata` look like, in words: 'an integer >= 1'."""
    if get_origin(tp) is Annotated:
        base, *extra = get_args(tp)
        return _kind(base, [*_flat(extra), *metadata], plural)
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " or ".join(_kind(a, metadata, plural) for a in args)
        return text + " or null" if len(args) < len(get_args(tp)) else text
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, get_args(tp)))
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        lo = next((m.min_length for m in metadata if isinstance(m, at.MinLen)), 0)
        hi = next((m.max_length for m in metadata if isinstance(m, at.MaxLen)), None)
        items = _kind(item, [], plural=True)
        if lo == 1 and hi is None:
            return f"a non-empty list of {items}"
        return f"a list of {f'{lo} ' if lo == hi else f'at least {lo} ' if lo else ''}{items}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if issubclass(tp, _Methods):
            return "a mapping of method names to their params"
        return f"a section with keys {', '.join(tp.model_fields) or '(none)'}"
    words = {bool: ("true or false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
             str: ("a string", "strings")}.get(tp, (getattr(tp, "__name__", str(tp)), str(tp)))
    text = words[1] if plural else words[0]
    if tp is str and any(isinstance(m, at.MinLen) and m.min_length == 1 for m in metadata):
        text = "non-empty strings" if plural else "a non-empty string"
    bounds = _bounds(metadata)
    return f"{text}{', each' if plural and bounds else ''}{' ' + bounds if bounds else ''}"


def _flat(metadata) -> list:
    out = []
    for m in metadata:
        out += m.metadata if isinstance(m, FieldInfo) else [m]
    return out


def _bounds(metadata: list) -> str:
    lo = next(((m.ge, "[") for m in metadata if isinstance(m, at.Ge)), None) or next(
        ((m.gt, "(") for m in metadata if isinstance(m, at.Gt)), None)
    hi = next(((m.le, "]") for m in metadata if isinstance(m, at.Le)), None) or next(
        ((m.lt, ")") for m in metadata if isinstance(m, at.Lt)), None)
    if lo and hi:
        return f"in {lo[1]}{lo[0]:g}, {hi[0]:g}{hi[1]}"
    if lo:
        return f"{'>=' if lo[1] == '[' else '>'} {lo[0]:g}"
    if hi:
        return f"{'<=' if hi[1] == ']' else '<'} {hi[0]:g}"
    return ""


def _in_order(raw: Any, valid: Any) -> Any:
    """`valid` with the keys of every mapping in `raw`'s order (the methods of a preset apply in the order given)."""
    if isinstance(raw, dict) and isinstance(valid, dict):
        return {k: _in_order(raw.get(k), valid[k]) for k in [*[k for k in raw if k in valid],
                                                              *[k for k in valid if k not in raw]]}
    return valid
