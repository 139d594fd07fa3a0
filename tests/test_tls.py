"""TLS for Flight and the control plane, with a CA and a server certificate made in the test."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import time
from pathlib import Path

import pytest
from api_support import free_port
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from data_support import make_groups

from knittrans.controlclient import ControlClient
from knittrans.errors import KnitTransError, Unavailable
from knittrans.flight import StoreClient, StoreServer, StoreServerConfig
from knittrans.procs import control_plane_args, knittrans_command
from knittrans.schema import build_unit_tables
from knittrans.store import StoreConfig
from knittrans.tickets import Ticket, UnitRead


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _make_pki(tmp: Path, name: str = "knittrans-test-ca") -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a CA and a server certificate for 127.0.0.1 / localhost."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (tmp / f"{name}.pem", tmp / "server.pem", tmp / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


def test_store_serves_grpc_tls_to_clients_that_verify_the_ca(tmp_path: Path, store_dir: Path) -> None:
    """A TLS store round-trips a unit for a client trusting its CA (it opens no data lane, so a default
    client reads through DoGet); a client trusting another CA is refused."""
    ca, cert, key = _make_pki(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _, _ = _make_pki(tmp_path / "other", "other-ca")
    srv = StoreServer(StoreServerConfig(store=StoreConfig(root=store_dir), tls_cert=cert, tls_key=key))
    try:
        assert srv.endpoint.startswith("grpc+tls://127.0.0.1:")
        t = build_unit_tables(make_groups(2, 3, seed=3))
        with StoreClient(srv.endpoint, tls_ca=ca) as c:
            assert c.put_unit("job", "u0", t.traj, t.media)["num_rows"] == 6
            assert c.get(Ticket(job="job", reads=(UnitRead(unit_id="u0"),))).equals(t.traj)
            assert srv.lane is None and c.data_lane and c.lane_port() is None
        with StoreClient(srv.endpoint, tls_ca=other_ca, timeout_s=10) as c, pytest.raises(KnitTransError):
            c.health()
        with StoreClient(srv.endpoint.replace("grpc+tls", "grpc"), timeout_s=10) as c, pytest.raises(KnitTransError):
            c.health()  # plaintext to a TLS port
    finally:
        srv.shutdown()


def test_control_plane_serves_https_to_clients_that_verify_the_ca(tmp_path: Path) -> None:
    """``knittrans control-plane --tls-cert/--tls-key`` answers HTTPS; the client verifies the CA."""
    ca, cert, key = _make_pki(tmp_path)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    cmd = knittrans_command(*control_plane_args(tmp_path / "cp.db", port=port, log_level="WARNING", extra=tls))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with ControlClient(url, tls_ca=ca, retries=0) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    assert client.health()["status"] == "ok"
                    break
                except Unavailable:
                    assert proc.poll() is None and time.monotonic() < deadline
                    time.sleep(0.1)
        with ControlClient(url, retries=0) as untrusting, pytest.raises(Unavailable, match="CERTIFICATE"):
            untrusting.health()
    finally:
        proc.kill()
        proc.wait()
