"""Where and how the Serve gRPC proxy listens: the interface (loopback by default) and TLS.

Ray Serve's proxy always listens on `[::]:PORT` without TLS (`ray.serve._private.default_impl.add_grpc_address`,
the module Ray keeps for such overrides). `clipstream serve` starts its local Ray with `install` as the workers'
setup hook; it replaces that function, in the process that imports it, by one that looks up the port in Ray's
key-value store: `publish` (the driver, before `serve.start`) writes there the host and certificate files for
the port, and the proxy acknowledges what it bound, so `confirm` can fail loudly if a proxy listened some other
way (Serve already running, Ray started without the hook). Other ports (the replicas' internal gRPC servers)
bind as Ray binds them.

Importing Serve costs ~2 s, and every Ray worker (training, Ray Data tasks) runs the setup hook: the patch is
applied only when a process imports that module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import ipaddress
import json
import sys
import time
from typing import Optional

TARGET = "ray.serve._private.default_impl"
NAMESPACE = "clipstream"
HOOK = f"{__name__}.install"


class BindingError(RuntimeError):
    """The gRPC port would listen, or listened, other than the settings say."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def address(host: str, port: int) -> str:
    """`host:port` for gRPC, IPv6 literals bracketed."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check(settings) -> None:
    """Refuse to listen beyond loopback without an API key, unless the settings explicitly allow it."""
    if not is_loopback(settings.grpc_host) and not settings.secret("api_key") and not settings.grpc_allow_unauthenticated:
        raise BindingError(f"grpc_host={settings.grpc_host} listens beyond this machine without an API key: set "
                           "CLIPSTREAM_API_KEY_FILE (or CLIPSTREAM_API_KEY), or CLIPSTREAM_GRPC_ALLOW_UNAUTHENTICATED=true "
                           "on a network where every client is trusted")


def publish(settings) -> None:
    """Tell the proxy (through Ray's key-value store) how to listen on settings.grpc_port."""
    from ray.experimental import internal_kv

    spec = json.dumps({"host": settings.grpc_host, "cert": str(settings.tls_cert_file or ""),
                       "key": str(settings.tls_key_file or "")})
    if (internal_kv._internal_kv_get(_key(settings.grpc_port), namespace=NAMESPACE) or b"").decode() == spec:
        return  # a proxy already listening this way stays acknowledged (a redeploy on a running Serve)
    internal_kv._internal_kv_put(_key(settings.grpc_port), spec, overwrite=True, namespace=NAMESPACE)
    internal_kv._internal_kv_del(_key(settings.grpc_port, "bound"), namespace=NAMESPACE)


def confirm(settings, timeout_s: float = 10.0) -> str:
    """What the proxy acknowledged binding for settings.grpc_port; BindingError if it did not apply the settings."""
    from ray.experimental import internal_kv

    deadline = time.monotonic() + timeout_s
    while True:
        bound = internal_kv._internal_kv_get(_key(settings.grpc_port, "bound"), namespace=NAMESPACE)
        if bound is not None:
            return bound.decode()
        if time.monotonic() > deadline:
            raise BindingError(f"the Serve gRPC proxy on port {settings.grpc_port} did not apply these host and TLS "
                               "settings: Serve was already running with other ones (shut it down first), or Ray was "
                               "started without clipstream's setup hook (start it with `clipstream serve`)")
        time.sleep(0.1)


def install() -> None:
    """Ray's `worker_process_setup_hook`: patch the proxy's bind when (if ever) this process imports it."""
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch(default_impl) -> None:
    original = default_impl.add_grpc_address
    if getattr(original, "clipstream", False):
        return

    def add_grpc_address(server, where: str) -> None:
        spec = _spec(int(where.rpartition(":")[2]))
        if spec is None:  # a replica's internal server, or a port clipstream did not publish
            return original(server, where)
        bound = address(spec["host"], int(where.rpartition(":")[2]))
        if spec["cert"]:
            import grpc

            with open(spec["cert"], "rb") as cert, open(spec["key"], "rb") as key:
                server.add_secure_port(bound, grpc.ssl_server_credentials([(key.read(), cert.read())]))
        else:
            server.add_insecure_port(bound)
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(_key(int(where.rpartition(":")[2]), "bound"),
                                     f"{bound} {'tls' if spec['cert'] else 'plaintext'}", namespace=NAMESPACE)

    add_grpc_address.clipstream = True
    default_impl.add_grpc_address = add_grpc_address


def _spec(port: int) -> Optional[dict]:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(_key(port), namespace=NAMESPACE)
    return json.loads(raw) if raw else None


def _key(port: int, suffix: str = "listen") -> str:
    return f"grpc:{port}:{suffix}"
