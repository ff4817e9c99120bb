"""`clipstream serve` and the commands that ask the running service: `status`, `health`, `encode`, `search`,
`items`."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from clipstream.cli.render import format_hits, format_table, print_json
from clipstream.settings import Settings


def _serve(args) -> None:
    from clipstream.runtime import stop_on_sigterm
    from clipstream.services import app, binding
    from clipstream.services.health import SERVICES

    settings = Settings(**({"serve_replicas": args.replicas} if args.replicas else {}))
    app.serve(settings)
    if not args.no_follow:  # a production alias moved in MLflow gets its gallery, then serving switches
        import threading

        from clipstream.promotion import follow_forever

        threading.Thread(target=follow_forever, args=(settings,), daemon=True, name="follow-production").start()
    stop_on_sigterm()  # a pod's stop: the same clean exit as Ctrl-C
    where = binding.address(settings.grpc_host, settings.grpc_port)
    print(f"serving {', '.join(SERVICES)} as application {settings.serve_app} on {where} "
          f"({'TLS' if settings.tls else 'plaintext'}; reflection and grpc.health.v1 on"
          f"{'; API key required' if settings.secret('api_key') else ''}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _client(args, **options):
    from clipstream.services.client import Client

    settings = Settings()
    # the application named in every call: the proxy routes by it where several share it (one alone takes any name)
    client = Client(args.address or settings.server or f"127.0.0.1:{settings.grpc_port}",
                    api_key=settings.secret("api_key"), tls=args.tls or settings.tls,
                    ca_file=settings.tls_ca_file or settings.tls_cert_file, application=settings.serve_app, **options)
    args.address = client.address  # what the command's output names
    return client


def _status(args) -> None:
    with _client(args) as client:
        status, versions = client.status(), client.versions()
    if args.json:
        return print_json({"status": status, "versions": versions})
    print(f"stream {status['stream']}: production v{status['production_version'] or '-'}, queries encoded by "
          f"v{status['query_version'] or '-'}, index generation {status['index_generation']}, "
          f"loaded {', '.join('v' + v for v in status['loaded_versions']) or 'none'}")
    print(format_table([("task", "#", "vectors from", "images", "texts", "indexed at")] + [
        (t["task"], str(t["task_index"]), "v" + t["model_version"], str(t["images"]), str(t["texts"]), t["indexed_at"])
        for t in status["tasks"]]))
    print(format_table([("version", "task", "method", "parent", "aliases", "loaded", "created")] + [
        ("v" + v["version"], v["task"], v["method"], v["parent_version"], ",".join(v["aliases"]),
         "yes" if v["loaded"] else "", v["created_at"]) for v in versions]))
    print("consistent" if status["consistent"] else "NOT consistent:\n  " + "\n  ".join(status["problems"]))


def _health(args) -> int:
    """A probe for people and for `helm test`: one line, exit 0 only when the service answers SERVING; a server that
    does not answer fails at once (no retries: a probe's caller retries), exit 3."""
    with _client(args, retries=0, timeout_s=args.timeout) as client:
        status = client.health(args.service)
    if args.json:
        print_json({"address": args.address, "service": args.service, "status": status})
    else:
        print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


def _encode(args) -> None:
    with _client(args) as client:
        vectors, version = (client.encode_image(args.image, model_version=args.model_version) if args.image
                            else client.encode_text(args.text, model_version=args.model_version, language=args.language))
    if args.json:
        return print_json({"model_version": version, "dimension": int(vectors.shape[1]),
                           "items": [{"input": str(item), "vector": vector} for item, vector in
                                     zip(args.image or args.text, vectors)]})
    for item, vector in zip(args.image or args.text, vectors):
        print(f"{str(item)[:40]:<40} " + " ".join(f"{v:+.3f}" for v in vector[:8]) + " ...")
    print(f"{len(vectors)} vectors of dimension {vectors.shape[1]} from model version {version}")


def _search(args) -> None:
    where = parse_filters(args.filter)
    with _client(args) as client:
        hits = client.search(text=args.query if not args.image else None, image=args.image, task=args.task or "",
                             k=args.k, model_version=args.model_version, language=args.language, filters=where,
                             score_threshold=args.score_threshold)
    if args.json:
        return print_json({"query": args.query if not args.image else args.image, "task": args.task, "hits": hits})
    print(format_hits(hits, args.query if not args.image else args.image, args.task))


def _items_add(args) -> None:
    items = read_items(args.file)
    with _client(args) as client:
        result = client.add_items(args.catalogue, items, batch_size=args.batch_size)
    if args.json:
        return print_json({"catalogue": args.catalogue, **result})
    print(f"catalogue {args.catalogue}: {result['added']} added, {result['replaced']} replaced (embedded by version "
          f"{result['model_version']}, index generation {result['index_generation']})")


def _items_delete(args) -> None:
    with _client(args) as client:
        result = client.delete_items(args.catalogue, args.item_ids)
    if args.json:
        return print_json({"catalogue": args.catalogue, **result})
    print(f"catalogue {args.catalogue}: {result['deleted']} deleted"
          + (f"; not in it: {', '.join(result['not_found'])}" if result["not_found"] else ""))


def parse_filters(texts: list[str]) -> dict:
    """`--filter` options as the client's filters: FIELD=V1,V2 (any of; each value read as JSON, else a string),
    FIELD>=X and FIELD<=X (a range, the two bounds of one field combined)."""
    where: dict = {}
    for text in texts:
        found = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|=)\s*(.*?)\s*", text)
        if not found or not found.group(3):
            raise ValueError(f"--filter {text!r}: write FIELD=V1,V2 (any of), FIELD>=X or FIELD<=X")
        field, op, value = found.groups()
        if op == "=":
            if field in where:
                raise ValueError(f"--filter {text!r}: {field} is filtered twice; put every value in one FIELD=V1,V2")
            where[field] = [_json_or_text(v) for v in value.split(",")]
            continue
        bounds = where.setdefault(field, {})
        if not isinstance(bounds, dict):
            raise ValueError(f"--filter {text!r}: {field} already has values (=); a field takes values or a range")
        try:
            bounds["gte" if op == ">=" else "lte"] = float(value)
        except ValueError:
            raise ValueError(f"--filter {text!r}: a bound must be a number, got {value!r}") from None
    return where


def _json_or_text(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (str, int, float)) and not isinstance(value, bool) else text


def read_items(path: str) -> list[dict]:
    """A JSON-lines file of items (item_id, image, image_uri, text, metadata), an image path relative to the file
    made absolute; a bad line is a ValueError naming it."""
    file = Path(path)
    items = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: an item is a JSON object, got {type(item).__name__}")
        unknown = set(item) - {"item_id", "image", "image_uri", "text", "metadata"}
        if unknown:
            raise ValueError(f"{path}:{number}: unknown keys {sorted(unknown)} (an item has item_id, image, image_uri, "
                             "text, metadata)")
        if item.get("image"):
            image = file.parent / str(item["image"])
            if not image.is_file():
                raise ValueError(f"{path}:{number}: image {item['image']!r} is not a file ({image})")
            item["image"] = image
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items
