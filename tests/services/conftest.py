"""A real Ray Serve app on loopback gRPC, serving versions registered without training."""

import contextlib
import io

from PIL import Image


@contextlib.contextmanager
def side_app(settings, timeout_s: float = 60.0):
    """An application of its own (settings.serve_app, reserving no CPU as the shared one), deployed beside the session's
    shared app on its proxy (the `served` fixture's grpc_port) as `clipstream serve` deploys it; deleted at the end
    (only it), once the proxy no longer routes to it, so that callers naming no application reach the shared app
    alone again. Yields the address."""
    import time

    import grpc
    from ray import serve
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    from clipstream.services import app

    assert settings.serve_app != app.APP and settings.serve_encoder_cpus == settings.serve_search_cpus == 0, \
        "a side app has a name of its own and reserves no CPU (the session's Ray has 2, for the training tests too)"
    target = app.serve(settings, timeout_s=timeout_s)
    try:
        yield target
    finally:
        serve.delete(settings.serve_app)
        with grpc.insecure_channel(target) as channel:
            ask = serve_pb2_grpc.RayServeAPIServiceStub(channel).ListApplications
            deadline = time.monotonic() + timeout_s
            while settings.serve_app in ask(serve_pb2.ListApplicationsRequest()).application_names:
                assert time.monotonic() < deadline, f"the proxy still routes to {settings.serve_app} after its deletion"
                time.sleep(0.2)


def set_production(settings, stub, version: str, timeout_s: float = 20.0) -> None:
    """Move alias `production` and wait until the Encoder serves it (it re-reads aliases every 2 s)."""
    import time

    from clipstream.registry import Registry
    from clipstream.v1 import encoder_pb2

    registry = Registry(settings)
    registry.set_alias("production", version)
    deadline = time.monotonic() + timeout_s
    while stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a cup"])).model_version != version:
        assert time.monotonic() < deadline, f"the Encoder did not switch to v{version}"
        time.sleep(0.2)


def self_signed(folder, host: str = "127.0.0.1"):
    """A self-signed certificate for `host` (IP and localhost in its SANs) and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "clipstream-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host)),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def wait_serving(channel, timeout_s: float = 60.0, application: str | None = None) -> None:
    """Until the server's health is SERVING (its proxy refreshes it every second once a model and a gallery are in
    place), that of `application` when named (else the one the channel's calls name, or the default)."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + timeout_s
    named = (("application", application),) if application else None
    while stub.Check(health_pb2.HealthCheckRequest(), metadata=named).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the server never became SERVING"
        time.sleep(0.25)


def png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(buf, format="PNG")
    return buf.getvalue()
