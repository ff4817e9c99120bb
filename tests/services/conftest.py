"""A real Ray Serve app on loopback gRPC, serving versions registered without training."""

import io

from PIL import Image

LAST = "test_live_promotion.py"  # replaces the shared app: run it after the other service tests


def pytest_collection_modifyitems(session, config, items):
    """Run the live-promotion module after every other test that uses the shared app, so it need not deploy
    the shared app again afterwards (a ~30 s redeploy on 2 cores); see `still_needed`."""
    last = [i for i in items if i.path.name == LAST]
    if last:
        at = items.index(last[0])
        rest = [i for i in items[at:] if i.path.name != LAST]
        cut = next((k for k, i in enumerate(rest) if "served" not in i.fixturenames), len(rest))
        items[at:] = rest[:cut] + last + rest[cut:]


def still_needed(request, fixture: str = "served") -> bool:
    """Whether a test after the requesting module's last one uses `fixture` (for a module-scoped fixture)."""
    items = request.session.items
    mine = [k for k, i in enumerate(items) if i.path == request.path]
    return any(fixture in i.fixturenames for i in items[max(mine, default=-1) + 1:])


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


def wait_serving(channel, timeout_s: float = 60.0) -> None:
    """Until the server's health is SERVING (its proxy refreshes it every second once a model and a gallery are in place)."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + timeout_s
    while stub.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "the server never became SERVING"
        time.sleep(0.25)


def png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(buf, format="PNG")
    return buf.getvalue()
