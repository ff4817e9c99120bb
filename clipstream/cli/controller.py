"""`clipstream controller`: the stream controller (clipstream/controller.py), in Kubernetes or on a Ray Jobs API."""

from __future__ import annotations


def _controller(args) -> None:
    from clipstream import controller, k8s
    from clipstream.settings import Settings
    from clipstream.training.methods.config import resolve

    resolve(args.method, args.set)  # a typo fails here, not in every job
    stream = k8s.dns_name(args.name, limit=12)
    release = k8s.Release(args.release, args.namespace, args.image or k8s.default_image(args.variant))
    resources = k8s.Resources(args.workers, args.gpus_per_worker, args.worker_cpus, args.worker_memory)
    plan = controller.Plan(stream, args.method, release, resources, args.set, args.zero_shot)
    backend = (controller.RayJobs(args.jobs_api, stream) if args.jobs_api
               else controller.KubeRayJobs(args.namespace, stream, args.release))
    ctl = controller.Controller(args.source, plan, backend, Settings(), args.parent, args.promote, args.on_failure,
                                say=lambda line: print(f"[controller] {line}", flush=True))
    if args.once:
        ctl.once()
    else:
        ctl.run(args.interval)
