"""zmqdp.keys: CURVE key generation and loading, its CLI, and a real libzmq handshake."""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from zmqdp.__main__ import main
from zmqdp.keys import (
    ClientKeys,
    EngineKeys,
    generate_keys,
    load_client_keys,
    load_engine_keys,
)

ENGINES = 3


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    generate_keys(directory, ENGINES)
    return directory


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_cert(path: Path, public: bytes, secret: bytes | None = None) -> None:
    """A certificate file in pyzmq's format with arbitrary (possibly broken) contents."""
    text = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    path.write_text(text)
    if secret is not None:
        path.chmod(0o600)


# --- generate and load ---------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    files = generate_keys(directory, ENGINES)
    names = ["client"] + [f"rank-{r}" for r in range(ENGINES)]
    assert files == [directory / f"{n}{s}" for n in names for s in (".key", ".key_secret")]
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in files)

    client = load_client_keys(directory)
    assert zmq.curve_public(client.secret) == client.public
    assert client.ranks() == list(range(ENGINES))
    for rank in range(ENGINES):
        engine = load_engine_keys(str(directory), rank)
        assert engine.server == client.public
        assert zmq.curve_public(engine.secret) == engine.public
        assert client.allowed[engine.public] == rank
        for key in (engine.public, engine.secret, engine.server):
            assert len(key) == 40
            assert len(z85.decode(key)) == 32
    assert len({load_engine_keys(directory, r).secret for r in range(ENGINES)}) == ENGINES


def test_each_machine_needs_only_its_files(keydir: Path, tmp_path: Path) -> None:
    client_dir, engine_dir = tmp_path / "client", tmp_path / "engine1"
    client_dir.mkdir()
    engine_dir.mkdir()
    for name in ["client.key_secret", *(f"rank-{r}.key" for r in range(ENGINES))]:
        shutil.copy2(keydir / name, client_dir / name)
    for name in ["rank-1.key_secret", "client.key"]:
        shutil.copy2(keydir / name, engine_dir / name)

    assert load_client_keys(client_dir) == load_client_keys(keydir)
    assert load_engine_keys(engine_dir, 1) == load_engine_keys(keydir, 1)


def test_file_modes(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b"
    files = generate_keys(directory, 2)
    assert mode(directory) == 0o700
    for path in files:
        assert mode(path) == (0o600 if path.name.endswith(".key_secret") else 0o644)
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no staging left


def test_existing_directory_mode_is_left_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    generate_keys(tmp_path, 1)
    assert mode(tmp_path) == 0o755
    assert mode(tmp_path / "client.key_secret") == 0o600


def test_refuses_to_overwrite(keydir: Path) -> None:
    before = {p.name: p.read_bytes() for p in keydir.iterdir()}
    with pytest.raises(FileExistsError, match=re.escape(str(keydir / "client.key"))):
        generate_keys(keydir, ENGINES)
    (keydir / "client.key").unlink()  # any one existing file is enough to refuse
    with pytest.raises(FileExistsError, match=re.escape("client.key_secret")):
        generate_keys(keydir, ENGINES)
    assert {p.name: p.read_bytes() for p in keydir.iterdir()} == {
        k: v for k, v in before.items() if k != "client.key"
    }


def test_force_replaces_keys_and_drops_stale_ranks(keydir: Path) -> None:
    old = load_client_keys(keydir)
    with pytest.raises(FileExistsError, match="key file exists"):
        generate_keys(keydir, 2)
    generate_keys(keydir, 2, force=True)
    new = load_client_keys(keydir)
    assert new.public != old.public
    assert new.ranks() == [0, 1]  # rank-2 is gone, not left on the allow-list
    assert not (keydir / "rank-2.key").exists()
    assert not (keydir / "rank-2.key_secret").exists()


@pytest.mark.parametrize("engines", [0, -1, 65537, True, 1.5])
def test_generate_rejects_bad_engine_count(tmp_path: Path, engines: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="engines must be"):
        generate_keys(tmp_path, engines)
    assert list(tmp_path.iterdir()) == []


# --- validation on load -----------------------------------------------------------------


@pytest.mark.parametrize("secret_mode", [0o640, 0o604, 0o644, 0o660])
def test_refuses_secret_readable_by_others(keydir: Path, secret_mode: int) -> None:
    loaders: list[tuple[Path, Callable[[], object]]] = [
        (keydir / "client.key_secret", lambda: load_client_keys(keydir)),
        (keydir / "rank-1.key_secret", lambda: load_engine_keys(keydir, 1)),
    ]
    for path, load in loaders:
        path.chmod(secret_mode)
        with pytest.raises(PermissionError, match=re.escape(f"chmod 600 {path}")):
            load()
        path.chmod(0o600)
        load()


@pytest.mark.parametrize("public_mode", [0o666, 0o664, 0o646, 0o620])
def test_refuses_public_key_others_can_write(keydir: Path, public_mode: int) -> None:
    """An allow-list entry (or the engine's copy of the client key) that group or others
    can write would let them add a rank or impersonate the client (issue 24 #4)."""
    loaders: list[tuple[Path, Callable[[], object]]] = [
        (keydir / "rank-1.key", lambda: load_client_keys(keydir)),
        (keydir / "client.key", lambda: load_engine_keys(keydir, 1)),
    ]
    for path, load in loaders:
        path.chmod(public_mode)
        with pytest.raises(PermissionError, match=re.escape(f"chmod go-w {path}")):
            load()
        path.chmod(0o644)
        load()


@pytest.mark.parametrize("dir_mode", [0o777, 0o775, 0o757, 0o1777])
def test_refuses_key_directory_others_can_write(keydir: Path, dir_mode: int) -> None:
    keydir.chmod(dir_mode)
    try:
        for load in (lambda: load_client_keys(keydir), lambda: load_engine_keys(keydir, 0)):
            with pytest.raises(PermissionError, match="writable by group/others"):
                load()
    finally:
        keydir.chmod(0o755)
    load_client_keys(keydir)
    load_engine_keys(keydir, 0)


def test_missing_files(keydir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_client_keys(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=re.escape(str(keydir / "rank-7.key_secret"))):
        load_engine_keys(keydir, 7)
    (keydir / "client.key").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(keydir / "client.key"))):
        load_engine_keys(keydir, 0)
    load_client_keys(keydir)  # the client machine does not need client.key
    (keydir / "client.key_secret").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("client.key_secret")):
        load_client_keys(keydir)


@pytest.mark.parametrize("rank", [-1, 65536, True, "0"])
def test_load_engine_keys_rejects_bad_rank(keydir: Path, rank: Any) -> None:
    with pytest.raises(ValueError, match="rank"):
        load_engine_keys(keydir, rank)


@pytest.mark.parametrize(
    ("public", "reason"),
    [
        (b"tooshort", "40-character"),
        (b"~" * 40, "Z85 alphabet"),
        (b"#" * 40, "not valid Z85"),  # each 5-character group decodes above 2**32
        (b"", "40-character"),
    ],
)
def test_malformed_public_key(keydir: Path, public: bytes, reason: str) -> None:
    path = keydir / "rank-1.key"
    write_cert(path, public)
    with pytest.raises(ValueError, match=reason) as info:
        load_client_keys(keydir)
    assert str(path) in str(info.value)


def test_file_without_public_key(keydir: Path) -> None:
    path = keydir / "rank-0.key"
    path.write_text("just some text\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: no public-key line"):
        load_client_keys(keydir)


def test_malformed_secret_key(keydir: Path) -> None:
    path = keydir / "rank-0.key_secret"
    public = load_engine_keys(keydir, 0).public
    write_cert(path, public, b"x" * 39)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_engine_keys(keydir, 0)
    write_cert(path, public)  # a public-only file under the secret name
    path.chmod(0o600)
    with pytest.raises(ValueError, match="no secret-key line"):
        load_engine_keys(keydir, 0)


def test_mismatched_public_and_secret(keydir: Path) -> None:
    path = keydir / "client.key_secret"
    public, _ = zmq.curve_keypair()
    secret = load_client_keys(keydir).secret
    write_cert(path, public, secret)
    with pytest.raises(ValueError, match="does not belong to the secret key") as info:
        load_client_keys(keydir)
    assert str(path) in str(info.value)
    assert secret.decode() not in str(info.value)


def test_public_copy_disagreeing_with_secret_file(keydir: Path) -> None:
    shutil.copy2(keydir / "rank-0.key", keydir / "rank-1.key")
    with pytest.raises(ValueError, match="different public keys"):
        load_engine_keys(keydir, 1)


def test_same_public_key_for_two_ranks(keydir: Path) -> None:
    shutil.copy2(keydir / "rank-0.key", keydir / "rank-2.key")
    with pytest.raises(ValueError, match="same public key") as info:
        load_client_keys(keydir)
    assert "rank-0.key" in str(info.value)
    assert "rank-2.key" in str(info.value)


def test_client_key_in_allow_list(keydir: Path) -> None:
    shutil.copy2(keydir / "client.key", keydir / "rank-1.key")
    with pytest.raises(ValueError, match="client's own public key") as info:
        load_client_keys(keydir)
    assert "rank-1.key" in str(info.value)


@pytest.mark.parametrize("name", ["rank-x.key", "rank-01.key", "rank-.key", "rank-1 .key_secret"])
def test_rank_file_with_bad_rank_is_refused(keydir: Path, name: str) -> None:
    shutil.copy2(keydir / "rank-0.key", keydir / name)
    with pytest.raises(ValueError, match="not a decimal rank") as info:
        load_client_keys(keydir)
    assert name in str(info.value)
    with pytest.raises(ValueError, match="not a decimal rank"):
        generate_keys(keydir, ENGINES, force=True)


def test_unrelated_files_are_ignored(keydir: Path) -> None:
    (keydir / "README").write_text("hello")
    (keydir / "ranking.key").write_text("not ours")
    assert load_client_keys(keydir).ranks() == list(range(ENGINES))


# --- the dataclasses ------------------------------------------------------------------


def test_rank_of(keydir: Path) -> None:
    client = load_client_keys(keydir)
    for rank in range(ENGINES):
        public = load_engine_keys(keydir, rank).public
        assert client.rank_of(public) == rank
        assert client.rank_of(z85.decode(public)) == rank  # as a ZAP request carries it
    stranger, _ = zmq.curve_keypair()
    assert client.rank_of(stranger) is None
    assert client.rank_of(z85.decode(stranger)) is None
    assert client.rank_of(client.public) is None
    assert client.rank_of(b"") is None
    assert client.rank_of(b"\0" * 33) is None


def test_client_keys_validates_direct_construction() -> None:
    public, secret = zmq.curve_keypair()
    engines = [zmq.curve_keypair()[0] for _ in range(2)]
    ok = ClientKeys(public, secret, {engines[0]: 0, engines[1]: 5})
    assert ok.ranks() == [0, 5]

    bad: list[tuple[dict[str, Any], str]] = [
        ({"public": public[:-1]}, "40-character"),
        ({"secret": secret.decode()}, "expected bytes"),
        ({"public": engines[0]}, "does not belong"),
        ({"allowed": {engines[0]: -1}}, "outside"),
        ({"allowed": {engines[0]: True}}, "must be an int"),
        ({"allowed": {engines[0]: 1.0}}, "must be an int"),
        ({"allowed": {z85.decode(engines[0]): 0}}, "40-character"),
        ({"allowed": {public: 0}}, "client's own public key"),
        ({"allowed": {engines[0]: 1, engines[1]: 1}}, "rank 1 has more than one"),
        ({"allowed": [(engines[0], 0)]}, "mapping"),
    ]
    for change, message in bad:
        fields: dict[str, Any] = {"public": public, "secret": secret, "allowed": {}, **change}
        with pytest.raises(ValueError, match=message):
            ClientKeys(**fields)


def test_allow_list_is_a_frozen_copy() -> None:
    public, secret = zmq.curve_keypair()
    engine = zmq.curve_keypair()[0]
    source = {engine: 0}
    keys = ClientKeys(public, secret, source)
    source.clear()
    assert keys.rank_of(engine) == 0
    with pytest.raises(TypeError):
        keys.allowed[engine] = 1  # type: ignore[index]
    hash(keys)  # frozen and hashable despite the mapping


def test_engine_keys_validates_direct_construction() -> None:
    public, secret = zmq.curve_keypair()
    server = zmq.curve_keypair()[0]
    EngineKeys(public, secret, server)
    with pytest.raises(ValueError, match="does not belong"):
        EngineKeys(server, secret, public)
    with pytest.raises(ValueError, match="is the client's public key"):
        EngineKeys(public, secret, public)
    with pytest.raises(ValueError, match="server"):
        EngineKeys(public, secret, b"nope")


def test_repr_hides_secrets(keydir: Path) -> None:
    client = load_client_keys(keydir)
    engine = load_engine_keys(keydir, 0)
    for keys in (client, engine):
        for text in (repr(keys), str(keys), f"{keys}"):
            assert keys.secret.decode() not in text
            assert keys.public.decode() in text
            assert "secret=<hidden>" in text
    assert "ranks [0, 1, 2]" in repr(client)


# --- the CLI ----------------------------------------------------------------------------


def test_cli_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "g1"
    assert main(["keys", str(directory), "--engines", "2"]) == 0
    out = capsys.readouterr().out
    for name in ["client.key", "client.key_secret", "rank-0.key", "rank-1.key_secret"]:
        assert str(directory / name) in out
    assert "client machine: client.key_secret, rank-0.key, rank-1.key" in out
    assert "engine r: rank-r.key_secret and client.key" in out
    assert load_client_keys(directory).ranks() == [0, 1]

    assert main(["keys", str(directory), "--engines", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "client.key" in captured.err and "--force" in captured.err
    assert "Traceback" not in captured.err

    assert main(["keys", str(directory), "--engines", "1", "--force"]) == 0
    capsys.readouterr()
    assert load_client_keys(directory).ranks() == [0]


def test_cli_keys_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", str(tmp_path), "--engines", "0"]) == 2
    assert "engines must be in 1..65536" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["keys", str(blocker / "sub"), "--engines", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zmqdp keys: error:") and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:  # argparse usage errors exit 2 as well
        main(["keys", str(tmp_path)])
    assert info.value.code == 2


# --- a real CURVE handshake -------------------------------------------------------------


def poll_until(poller: zmq.Poller, seconds: float) -> dict[Any, int]:
    events = dict(poller.poll(int(seconds * 1000)))
    assert events, f"nothing happened within {seconds} s"
    return events


def test_keys_work_with_libzmq_curve(keydir: Path, ctx: zmq.Context[Any]) -> None:
    client = load_client_keys(keydir)
    engine = load_engine_keys(keydir, 0)
    url = f"ipc://{keydir.parent}/curve"

    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.curve_server = True
    router.curve_secretkey = client.secret
    router.bind(url)

    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.curve_serverkey = engine.server
    dealer.curve_publickey = engine.public
    dealer.curve_secretkey = engine.secret
    dealer.routing_id = (0).to_bytes(2, "little")
    dealer.connect(url)
    dealer.send_multipart([b"hello", b"world"])

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    assert router in poll_until(poller, 5.0)
    frames = router.recv_multipart(copy=False)
    assert [bytes(f) for f in frames] == [b"\x00\x00", b"hello", b"world"]
    assert client.rank_of(engine.public) == int.from_bytes(frames[0].bytes, "little")


def test_zap_handler_maps_key_to_rank(keydir: Path, ctx: zmq.Context[Any]) -> None:
    """What the ZAP wiring will do: a handler in the same context answers from
    `rank_of` with the rank as user id, which libzmq attaches to every received frame;
    a key not on the allow-list gets 400 and its handshake fails."""
    client = load_client_keys(keydir)
    url = f"ipc://{keydir.parent}/zap"

    zap = ctx.socket(zmq.REP)  # must exist before the server binds
    zap.linger = 0
    zap.bind("inproc://zeromq.zap.01")
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.curve_server = True
    router.curve_secretkey = client.secret
    router.bind(url)

    def dealer(engine: EngineKeys, rank: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.curve_serverkey = engine.server
        sock.curve_publickey = engine.public
        sock.curve_secretkey = engine.secret
        sock.routing_id = rank.to_bytes(2, "little")
        return sock

    public, secret = zmq.curve_keypair()
    stranger = dealer(EngineKeys(public, secret, client.public), 1)
    monitor = stranger.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    stranger.connect(url)
    good = dealer(load_engine_keys(keydir, 2), 2)
    good.connect(url)
    good.send(b"from rank 2")

    poller = zmq.Poller()
    for sock in (zap, router, monitor):
        poller.register(sock, zmq.POLLIN)
    replies: list[bytes] = []
    received: list[zmq.Frame] = []
    rejected = False
    deadline = time.monotonic() + 5.0
    while not (received and rejected):
        events = poll_until(poller, deadline - time.monotonic())
        if zap in events:
            version, request_id, _domain, _address, _identity, mechanism, key = zap.recv_multipart()
            assert mechanism == b"CURVE" and len(key) == 32
            rank = client.rank_of(key)
            status = b"400" if rank is None else b"200"
            user = b"" if rank is None else str(rank).encode()
            zap.send_multipart([version, request_id, status, b"", user, b""])
            replies.append(status)
        if router in events:
            received = router.recv_multipart(copy=False)
        if monitor in events:
            event = recv_monitor_message(monitor)
            assert event["value"] == 400
            rejected = True

    assert sorted(replies) == [b"200", b"400"]
    assert [f.bytes for f in received] == [b"\x02\x00", b"from rank 2"]
    # The user id is on the routing-id frame and the body alike.
    assert [f.get("User-Id") for f in received] == ["2", "2"]
    stranger.disable_monitor()
    monitor.close()


def test_secret_files_are_not_world_readable_after_umask_change(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        files = generate_keys(tmp_path / "k", 1)
    finally:
        os.umask(old)
    assert mode(tmp_path / "k") == 0o700
    assert all(mode(p) == 0o600 for p in files if p.name.endswith("_secret"))
