"""`clipstream serve` and the commands that ask the running service: `status`, `health`, `encode`, `search`."""

from __future__ import annotations

import time

from clipstream.cli.render import format_hits, format_table, print_json
from clipstream.settings import Settings


def _serve(args) -> None:
    from clipstream.runtime import init_ray, stop_on_sigterm
    from clipstream.services import app, binding
    from clipstream.services.health import SERVICES

    settings = Settings(**({"serve_replicas": args.replicas} if args.replicas else {}))
    binding.check(settings)  # before Ray starts: a refusal costs nothing
    app.serving_environment()
    init_ray(settings, setup_hook=binding.install)  # (the hook binds the Serve proxy as the settings say)
    app.start(settings)
    if not args.no_follow:  # a production alias moved in MLflow gets its gallery, then serving switches
        import threading

        from clipstream.promotion import follow_forever

        threading.Thread(target=follow_forever, args=(settings,), daemon=True, name="follow-production").start()
    stop_on_sigterm()  # a pod's stop: the same clean exit as Ctrl-C
    where = binding.address(settings.grpc_host, settings.grpc_port)
    print(f"serving {', '.join(SERVICES)} on {where} ({'TLS' if settings.tls else 'plaintext'}; reflection and "
          f"grpc.health.v1 on{'; API key required' if settings.secret('api_key') else ''}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _client(args, **options):
    from clipstream.services.client import Client

    settings = Settings()
    client = Client(args.address or settings.server or f"127.0.0.1:{settings.grpc_port}",
                    api_key=settings.secret("api_key"), tls=args.tls or settings.tls,
                    ca_file=settings.tls_ca_file or settings.tls_cert_file, **options)
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
    with _client(args) as client:
        hits = client.search(text=args.query if not args.image else None, image=args.image, task=args.task or "",
                             k=args.k, model_version=args.model_version, language=args.language)
    if args.json:
        return print_json({"query": args.query if not args.image else args.image, "task": args.task, "hits": hits})
    print(format_hits(hits, args.query if not args.image else args.image, args.task))
