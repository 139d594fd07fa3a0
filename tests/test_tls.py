"""TLS for Flight and the control plane, with a CA and a server certificate made in the test."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_support import free_port, rss_mib
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from data_support import make_groups

from knittrans.controlclient import ControlClient
from knittrans.errors import KnitTransError, Unavailable
from knittrans.flight import StoreClient, StoreServer, StoreServerConfig
from knittrans.procs import control_plane_args, knittrans_command, wait_ready, wait_until
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


@contextlib.contextmanager
def _https_control_plane(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, Path, int]]:
    """``knittrans control-plane --tls-cert/--tls-key`` started and answering: its URL, the CA to verify it, its pid."""
    ca, cert, key = _make_pki(tmp_path)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), *extra]
    cmd = knittrans_command(*control_plane_args(tmp_path / "cp.db", port=port, log_level="WARNING", extra=tls))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        with ControlClient(url, tls_ca=ca, retries=0) as client:
            wait_ready(proc, lambda: client.health()["status"] == "ok", timeout_s=120, what="HTTPS control plane")
        yield url, ca, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_control_plane_serves_https_to_clients_that_verify_the_ca(tmp_path: Path) -> None:
    """``knittrans control-plane --tls-cert/--tls-key`` answers HTTPS; the client verifies the CA."""
    with (
        _https_control_plane(tmp_path) as (url, _, _),
        ControlClient(url, retries=0) as untrusting,
        pytest.raises(Unavailable, match="CERTIFICATE"),
    ):
        untrusting.health()


def _answer(reply: Any) -> int:
    """Read one HTTP/1.1 response (with ``Content-Length``) from ``reply``; its status code."""
    status = int(reply.readline().split()[1])
    length = 0
    while (line := reply.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    reply.read(length)
    return status


def test_an_unauthenticated_https_connection_is_held_at_64_kib_though_tls_reads_are_larger(tmp_path: Path) -> None:
    """Over TLS, asyncio hands the protocol whatever it decrypted (more than 64 KiB at a time), so the connection
    guard cuts each read itself: 40 HTTPS connections each sending 4 MiB of one header line (httptools, no header
    limit of its own) leave the server far less than the 160 MiB they sent, and a client with a token is served."""
    auth = "Authorization: Bearer " + "w" * 24
    sent: list[int] = []
    done = threading.Event()

    def flood(port: int, context: ssl.SSLContext) -> None:
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1") as sock:
            sock.settimeout(5)  # a send the server does not read times out
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: cp\r\nX-Flood: ")
            total = 0
            with contextlib.suppress(OSError):
                while total < 4 << 20:
                    sock.sendall(b"a" * (256 << 10))
                    total += 256 << 10
            sent.append(total)
            done.wait(120)

    env = {**os.environ, "KNITTRANS_UNAUTHENTICATED_TIMEOUT_S": "120"}  # what bounds them here is not the timeout
    with _https_control_plane(tmp_path, "--http", "httptools", "--worker-token", "w" * 24, env=env) as (url, ca, pid):
        port = int(url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=str(ca))
        try:
            before = rss_mib(pid)
            floods = [threading.Thread(target=flood, args=(port, context)) for _ in range(40)]
            for thread in floods:
                thread.start()
            wait_until(lambda: len(sent) == len(floods), timeout_s=120, what="every flood finished or stalled")
            time.sleep(0.5)  # the server takes in what the last sends left in its socket buffers
            grown = rss_mib(pid) - before
            assert len(sent) == len(floods), "a flooding connection neither finished nor stalled in 120 s"
            assert grown < 48, f"the server grew by {grown:.0f} MiB while {sum(sent) >> 20} MiB of headers were sent"
            with context.wrap_socket(
                socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1"
            ) as sock:
                sock.settimeout(30)
                reply = sock.makefile("rb")
                sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: cp\r\n\r\n")  # open: no token yet
                assert _answer(reply) == 200
                body = b"[" + b" " * 300_000 + b"]"  # past 64 KiB: held until the token is checked, then read once
                head = (
                    f"POST /v1/jobs/absent/units HTTP/1.1\r\nHost: cp\r\n{auth}\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                sock.sendall(head.encode() + body)
                assert _answer(reply) == 422  # not a list of units: the whole body was read, then answered
                sock.sendall(f"GET /v1/nodes HTTP/1.1\r\nHost: cp\r\n{auth}\r\n\r\n".encode())
                assert _answer(reply) == 200
                reply.close()
        finally:
            done.set()
