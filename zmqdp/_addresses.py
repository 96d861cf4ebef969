"""Group URLs: where the client binds and what it advertises in INIT (docs/protocol.md §1).

For `ipc://P` the client binds the handshake at `ipc://P`, input at `ipc://P.in` and
output at `ipc://P.out`. The directory holding them is created with mode 0700 if it is
missing, and refused if another user owns it or group/others may enter or write it:
anyone who can write there can replace a socket file and impersonate an engine or the
client, and anyone who can enter it can connect to the sockets. Stale socket files are
removed before binding (never other kinds of file, and never a socket a live process
still serves: a second group on the same URL is refused instead of silently taking the
first one's sockets); the group removes its socket files when it closes.

For `tcp://H:PORT` the handshake binds there and input/output bind on OS-chosen ports
of the same host. A wildcard host (`*`, `0.0.0.0`, `::`) cannot be advertised, so it
needs an explicit `advertise_host`. A host other than the loopback interface is reachable
from other machines (`GroupAddress.loopback` says which), and a loopback port by every
local user, so the transport refuses any tcp URL without CURVE keys unless the caller
says `insecure=True`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "GroupAddress",
    "is_ipv6",
    "is_loopback",
    "parse_group_url",
    "prepare_ipc_directory",
    "remove_socket_files",
    "socket_paths",
]

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", "[*]"})


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where to bind. For tcp, input/output end in ':*' (the OS picks the port)."""

    transport: Literal["ipc", "tcp"]
    handshake: str
    input: str
    output: str
    advertise_host: str | None = None  # tcp: the host INIT names
    ipv6: bool = False
    loopback: bool = True
    """Only this machine can connect (ipc, or tcp on a loopback address)."""

    def advertised(self, bound: str) -> str:
        """The address to put in INIT for a socket bound at `bound` (its LAST_ENDPOINT)."""
        if self.transport != "tcp" or self.advertise_host is None:
            return bound
        port = bound.rsplit(":", 1)[1]
        host = self.advertise_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{port}"


def is_ipv6(address: str) -> bool:
    """Whether a ZeroMQ address names an IPv6 host (`tcp://[::1]:5555`, `tcp://::1:5555`
    or a bare IPv6 host): such sockets need the `IPV6` option. The one check of zmqdp."""
    if address.startswith("tcp://"):
        address = address[len("tcp://") :].rpartition(":")[0] or address[len("tcp://") :]
    elif "://" in address:
        return False
    return ":" in address


def is_loopback(host: str) -> bool:
    """Whether a tcp host names this machine's loopback interface only (`localhost`,
    `127.x.y.z`, `::1`). Names are not resolved: anything else counts as reachable."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_group_url(url: str, advertise_host: str | None = None) -> GroupAddress:
    """Check a group URL and derive the three bind addresses. Raises ValueError with
    what is wrong and how to fix it."""
    if url.startswith("ipc://"):
        path = url[len("ipc://") :]
        if not path:
            raise ValueError(f"group URL {url!r} has no path")
        return GroupAddress("ipc", url, f"{url}.in", f"{url}.out")
    if url.startswith("tcp://"):
        rest = url[len("tcp://") :]
        host, sep, port = rest.rpartition(":")
        if not sep or not host or not port:
            raise ValueError(f"group URL {url!r} must look like tcp://HOST:PORT")
        if port != "*" and not port.isdigit():
            raise ValueError(f"group URL {url!r}: port {port!r} is not a number")
        wildcard = host in WILDCARD_HOSTS
        if wildcard and not advertise_host:
            raise ValueError(
                f"group URL {url!r} binds a wildcard host, which engines cannot connect "
                "to: pass advertise_host=<an address the engines can reach>"
            )
        ipv6 = is_ipv6(host) or (advertise_host is not None and is_ipv6(advertise_host))
        return GroupAddress(
            "tcp",
            url,
            f"tcp://{host}:*",
            f"tcp://{host}:*",
            advertise_host if wildcard else None,
            ipv6,
            loopback=not wildcard and is_loopback(host),
        )
    raise ValueError(f"group URL {url!r}: only ipc:// and tcp:// are supported")


_SHARED_DIRECTORIES = frozenset({"/", "/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run"})
"""Directories other programs share: a fix never narrows their mode."""


def prepare_ipc_directory(address: GroupAddress) -> None:
    """Create or check the socket directory and remove stale socket files.
    Raises PermissionError with the fix if the directory is unsafe."""
    if address.transport != "ipc":
        return
    path = address.handshake[len("ipc://") :]
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"ipc directory {directory} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.getuid()}): use a directory of your own, e.g. under $XDG_RUNTIME_DIR"
        )
    if st.st_mode & 0o033:
        # Never `chmod` advice for a shared directory (/tmp, /dev/shm: sticky, or a
        # system one): narrowing it breaks every other program on the machine.
        shared = st.st_mode & stat.S_ISVTX or directory in _SHARED_DIRECTORIES
        fix = (
            f"put the socket in a directory of its own, e.g. ipc://{directory.rstrip('/')}"
            "/zmqdp-NAME/group (zmqdp creates it, private to this user)"
            if shared
            else f"make it private with: chmod go-wx {directory}, or use a directory of your own"
        )
        raise PermissionError(
            f"ipc directory {directory} can be entered or written by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}): other users could reach or replace the "
            f"sockets; {fix}"
        )
    for sock_path in socket_paths(address):
        try:
            mode = os.lstat(sock_path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(mode):
            raise FileExistsError(f"{sock_path} exists and is not a socket; refusing to replace it")
        if _is_served(sock_path):
            raise FileExistsError(
                f"{sock_path} is served by a live process (another engine group on "
                f"{address.handshake}?): refusing to take it over; use another URL"
            )
        os.unlink(sock_path)


def socket_paths(address: GroupAddress) -> list[str]:
    """The socket files of an ipc group (none for tcp)."""
    if address.transport != "ipc":
        return []
    path = address.handshake[len("ipc://") :]
    return [path, f"{path}.in", f"{path}.out"]


def _is_served(sock_path: str) -> bool:
    """Whether a process accepts connections on this Unix socket (a stale file, left by
    a process that is gone, refuses them)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(sock_path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def remove_socket_files(address: GroupAddress) -> None:
    """After the group's sockets are closed: remove their files (libzmq does not
    always), so no stale socket is left behind."""
    for sock_path in socket_paths(address):
        try:
            if stat.S_ISSOCK(os.lstat(sock_path).st_mode):
                os.unlink(sock_path)
        except FileNotFoundError:
            pass
