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

`retry_dead_replicas`, the first of the application's gRPC servicer functions (services/app.py GRPC_SERVICERS, the
chart's serveConfigV2), makes the proxy answer UNAVAILABLE (retried by the client's retry policy) rather than
INTERNAL for a request whose replica died before answering. Serve calls the servicer functions inside each proxy
actor as it builds its gRPC server, however Ray was started (`clipstream serve`, or a RayService whose pods run
plain `ray start` with no setup hook), so this is where that patch is installed.
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
    """Ray's `worker_process_setup_hook`: patch Serve's gRPC listener when (if ever) this process imports it."""
    pending = [name for name in PATCHES if name not in sys.modules]
    for name in set(PATCHES) - set(pending):
        PATCHES[name](sys.modules[name])
    if pending and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(pending))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.pending = set(names)

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        sys.meta_path.remove(self)  # (find the real spec without finding ourselves)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def retry_dead_replicas(_placeholder, server) -> None:
    """A gRPC servicer function of the application (called by Serve's proxy with its gRPC server, before the
    application's services are added): a replica that dies holding a request (killed, its node lost) fails that
    request with INTERNAL in Serve's proxy; nothing was answered and every clipstream RPC is a read, so say
    UNAVAILABLE, in a way the client's retry policy retries on a live replica."""
    from ray.serve._private import proxy

    _patch_status(proxy)
    server.service_handler_factory = _aborting(server.service_handler_factory, proxy.gRPCStreamingType.UNARY_UNARY)


def _patch_status(proxy) -> None:
    """The proxy's status of an exception (a module function it looks up per request): UNAVAILABLE for a replica
    that died."""
    original = proxy.get_grpc_response_status
    if getattr(original, "clipstream", False):
        return
    from ray.exceptions import RayActorError
    from ray.serve._private.proxy_request_response import ResponseStatus

    def get_grpc_response_status(exc, *args, **kwargs):
        cause = getattr(exc, "original_exception", exc)
        if isinstance(cause, RayActorError):
            import grpc

            return ResponseStatus(code=grpc.StatusCode.UNAVAILABLE, is_error=True,
                                  message="the replica serving the request stopped before answering: retry")
        return original(exc, *args, **kwargs)

    get_grpc_response_status.clipstream = True
    proxy.get_grpc_response_status = get_grpc_response_status


def _aborting(factory, unary):
    """Serve's handler factory, whose unary handlers answer an error by setting the status and returning an empty
    message; gRPC then sends headers first, and a client's retry policy never retries a call whose headers arrived.
    Aborting instead sends the status alone (trailers-only), which the policy retries when it says UNAVAILABLE.
    (The server holds the factory it calls, bound at its creation: it is replaced there.)"""
    import grpc

    codes = {code.value[0]: code for code in grpc.StatusCode}

    def service_handler_factory(service_method, streaming_type):
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if streaming_type != unary:
            return handler

        async def unary_unary(request_proto, context):
            response = await handler(request_proto, context)
            code = context.code()
            code = codes.get(code, code) if isinstance(code, int) else code
            if code not in (None, grpc.StatusCode.OK):
                await context.abort(code, context.details() or "")
            return response

        return unary_unary

    return service_handler_factory


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


PATCHES = {TARGET: _patch}


def _spec(port: int) -> Optional[dict]:
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(_key(port), namespace=NAMESPACE)
    return json.loads(raw) if raw else None


def _key(port: int, suffix: str = "listen") -> str:
    return f"grpc:{port}:{suffix}"
