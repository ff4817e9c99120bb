"""`clipstream k8s job|stream`: RayJob manifests for kubectl."""

from __future__ import annotations

import time


def _k8s(args) -> None:
    """Print RayJob manifests; the preset and overrides are resolved first, so a typo fails here, not in the cluster."""
    from clipstream import k8s
    from clipstream.training.methods.config import resolve

    resolve(args.method, args.set)
    release = k8s.Release(args.release, args.namespace, args.image or k8s.default_image(args.variant))
    resources = k8s.Resources(args.workers, args.gpus_per_worker, args.worker_cpus, args.worker_memory)
    if args.k8s_command == "job":
        manifests = [k8s.job(args.task, args.method, release, resources, parent=args.parent, overrides=args.set,
                             name=args.name, zero_shot=args.zero_shot)]
    else:
        manifests = k8s.stream(args.tasks, args.method, release, resources, parent=args.parent, overrides=args.set,
                               name=args.name or time.strftime("s%Y%m%d-%H%M%S"), wait_parent_s=args.wait_parent,
                               zero_shot=args.zero_shot)
    print(k8s.dump(manifests), end="")
