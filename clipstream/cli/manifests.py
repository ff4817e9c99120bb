"""`clipstream k8s job|stream`: RayJob manifests for kubectl."""

from __future__ import annotations

import time


def _k8s(args) -> None:
    """Print RayJob manifests; the preset, the overrides and every Kubernetes value are checked first, so a typo
    fails here, not in the cluster."""
    from clipstream import k8s
    from clipstream.training.methods.config import resolve

    resolve(args.method, args.set)
    if args.image and (args.release_values or args.variant):
        raise ValueError("--image names the image: leave out --release-values and --variant")
    image = k8s.check_image(args.image) if args.image else k8s.release_image(args.release_values, args.variant)
    extras = k8s.extras(args.env, args.label, args.annotation)
    release = k8s.Release(args.release, args.namespace, image, k8s.runs_dir(args.runs_dir), args.ray_auth, extras)
    resources = k8s.Resources(args.workers, args.gpus_per_worker, args.worker_cpus, args.worker_memory,
                              node_selector=k8s.key_values(args.node_selector, "--node-selector"),
                              tolerations=[k8s.toleration(t) for t in args.toleration],
                              affinity=k8s.affinity(args.affinity) if args.affinity else {},
                              priority_class=k8s.priority_class(args.priority_class))
    if args.k8s_command == "job":
        manifests = [k8s.job(args.task, args.method, release, resources, parent=args.parent, overrides=args.set,
                             name=args.name, zero_shot=args.zero_shot)]
    else:
        manifests = k8s.stream(args.tasks, args.method, release, resources, parent=args.parent, overrides=args.set,
                               name=args.name or time.strftime("s%Y%m%d-%H%M%S"), wait_parent_s=args.wait_parent,
                               zero_shot=args.zero_shot)
    print(k8s.dump([k8s.network_policy(release), *manifests]), end="")
