"""Rank 0's links to the other ranks: one TCP connection each, which the control channels run on.

Why not gloo: a gloo collective crosses its process group's worker thread and its transport's
device thread on both ends, 0.5-1 ms a message on the 2-core host; a 64-byte broadcast and
all-gather took 2.4 ms a round on loopback, a send and receive 1.2 ms, against 0.03 ms for a
plain socket's ping-pong. With plans and results encoded and decoded, a 32-sequence decode step's
round trip is 0.87 ms over a link against 1.87 ms over gloo (``python -m benchmarks.control_wire``).
A rank stepping alone (every unit resident) paid it every step, on top of its forward.

Contract:

* :func:`open_links` is collective (every rank, once, after :func:`init_rank`): rank 0 listens
  on one address (:func:`control_host`) on a port the OS picks, sends the address and a fresh
  random token to every rank over the default group (``shard_engine.wire.broadcast``: that group
  is already authenticated, ``process_group.authenticate_group``), and every other rank
  connects and presents the token with its rank. A connection that does not is closed and
  logged; the listener closes once every rank is in, so no one joins later.
* A message is one frame: its length (8 bytes, little endian), then one msgpack value of plain
  data (``shard_engine.wire.encode``: nothing received is executed). Length 0 means the sender
  could not encode its value, and the receiver raises WireError naming it, as the wire's
  collectives do; a length above ``wire.MAX_BYTES`` is refused before anything is allocated.
* Every send and receive waits at most the timeout given (the group's collective timeout); a
  peer that is gone raises :class:`LinkError` at once (end of stream or reset), not after it.
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import secrets
import socket
import struct
import time

import torch.distributed as dist

from shard_engine import wire

logger = logging.getLogger(__name__)

CONTROL_HOST_ENV = "HSDP_CONTROL_HOST"
_HEADER = 8
_HELLO_TIMEOUT_S = 10.0  # a connection that says nothing this long is not one of ours
_HELLO_BYTES = 1024  # a rank's hello is its rank and a 64-character token


class LinkError(ConnectionError):
    """A link to ``peer`` (a global rank) closed, timed out, or could not be made."""

    def __init__(self, message: str, *, peer: int | None = None):
        self.peer = peer
        super().__init__(message)


class Link:
    """One end of a connection to global rank ``peer``: frames of plain data each way."""

    def __init__(self, sock: socket.socket, peer: int, timeout_s: float):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame goes out whole, at once
        sock.settimeout(timeout_s)
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s
        self._header = bytearray(_HEADER)
        # A second descriptor that nothing in Python closes: the connection ends when the process
        # does, as gloo's did. A failing rank's frames (and its socket objects) go seconds before
        # its process exits; a link closed with them reset rank 0's end at once, rank 0 failed
        # the group first, and the launcher named rank 0 instead of the rank at fault.
        self._held = os.dup(sock.fileno())

    def send(self, value) -> None:
        """``value`` as one frame. A value that is not plain data goes as length 0 (the peer
        raises, naming this rank) and raises WireError here too."""
        try:
            data = wire.encode(value)
        except wire.WireError:
            self.send_bytes(b"")
            raise
        self.send_bytes(data)

    def send_bytes(self, data: bytes) -> None:
        try:
            self.sock.sendall(len(data).to_bytes(_HEADER, "little") + data)
        except TimeoutError:
            raise LinkError(f"rank {self.peer} took nothing for {self.timeout_s:g} s", peer=self.peer) from None
        except OSError as e:
            raise LinkError(f"the link to rank {self.peer} is gone ({e})", peer=self.peer) from None

    def recv(self, max_bytes: int = wire.MAX_BYTES) -> object:
        """The next frame's value (WireError if the peer could not encode it, sent no plain data,
        or announced more than ``max_bytes``: refused before anything is allocated)."""
        self._recv_into(memoryview(self._header))
        length = int.from_bytes(self._header, "little")
        if length == 0:
            raise wire.WireError(f"rank {self.peer} could not encode its value (not plain data): see its log")
        if length > max_bytes:
            raise wire.WireError(f"rank {self.peer} sent a value of {length} bytes (at most {max_bytes} are taken)")
        data = bytearray(length)
        self._recv_into(memoryview(data))
        return wire.decode(data)

    def _recv_into(self, view: memoryview) -> None:
        while view:
            try:
                n = self.sock.recv_into(view)
            except TimeoutError:
                raise LinkError(f"nothing from rank {self.peer} for {self.timeout_s:g} s", peer=self.peer) from None
            except OSError as e:
                raise LinkError(f"the link to rank {self.peer} is gone ({e})", peer=self.peer) from None
            if n == 0:
                raise LinkError(f"rank {self.peer} closed its link (exited?)", peer=self.peer)
            view = view[n:]

    def close(self) -> None:
        self.sock.close()
        if self._held >= 0:
            os.close(self._held)
            self._held = -1


def control_host(world: int, environ=None) -> str:
    """The address rank 0's listener binds and the other ranks dial: ``HSDP_CONTROL_HOST`` where
    set; loopback where all ``world`` ranks are on this node; else the address of the interface gloo uses
    (``GLOO_SOCKET_IFNAME``), else that of the interface that routes to ``MASTER_ADDR`` (the node
    rank 0 runs on, under torchrun and docker/entrypoint.sh)."""
    environ = os.environ if environ is None else environ
    if environ.get(CONTROL_HOST_ENV):
        return environ[CONTROL_HOST_ENV]
    if int(environ.get("LOCAL_WORLD_SIZE", world)) >= world:
        return "127.0.0.1"
    interface = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return _interface_address(interface)
    master = environ.get("MASTER_ADDR")
    if not master:
        raise ValueError(f"the group spans several nodes and neither {CONTROL_HOST_ENV} nor MASTER_ADDR is set: "
                         "set HSDP_CONTROL_HOST to an address of rank 0's node that the other nodes reach")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
        probe.connect((master, int(environ.get("MASTER_PORT", "29500"))))
        return probe.getsockname()[0]


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (as gloo reads it)."""
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ValueError(f"GLOO_SOCKET_IFNAME={name}: no IPv4 address on that interface ({e})") from None
    return socket.inet_ntoa(packed[20:24])


def open_links(timeout_s: float) -> dict[int, Link]:
    """Collective: on rank 0 a link to every other rank, by rank; on the others the one to rank 0
    (keyed 0). Raises LinkError on every rank that cannot complete it within ``timeout_s``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return {}
    listener = token = None
    if rank == 0:
        host = control_host(world)
        listener = socket.create_server((host, 0), family=_family(host), backlog=world)
        token = secrets.token_hex(32)
        address = {"host": host, "port": listener.getsockname()[1], "token": token}
    try:
        # over the default group, which every rank has proved itself to (authenticate_group)
        address = wire.broadcast(address if rank == 0 else None, src=0)
        if rank != 0:
            return {0: _dial(address, rank, timeout_s)}
        return _accept(listener, token, world, timeout_s)
    finally:
        if listener is not None:
            listener.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]


def _dial(address: dict, rank: int, timeout_s: float) -> Link:
    where = f"{address['host']}:{address['port']}"
    try:
        sock = socket.create_connection((address["host"], address["port"]), timeout=timeout_s)
    except OSError as e:
        raise LinkError(f"rank {rank} cannot reach rank 0's control link at {where} ({e}); set {CONTROL_HOST_ENV} "
                        "to an address of rank 0's node that every node reaches", peer=0) from None
    link = Link(sock, 0, timeout_s)
    link.send({"rank": rank, "token": address["token"]})
    if link.recv() != "ok":
        raise LinkError(f"rank 0 refused rank {rank}'s control link", peer=0)
    return link


def _accept(listener: socket.socket, token: str, world: int, timeout_s: float) -> dict[int, Link]:
    links: dict[int, Link] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(links) < world - 1:
            listener.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                sock, peer_address = listener.accept()
            except TimeoutError:
                missing = sorted(set(range(1, world)) - set(links))
                raise LinkError(f"ranks {missing} did not open their control links within {timeout_s:g} s") from None
            link = Link(sock, -1, min(timeout_s, _HELLO_TIMEOUT_S))
            try:
                hello = link.recv(max_bytes=_HELLO_BYTES)  # (a stranger announcing a GiB gets nothing allocated)
            except (LinkError, wire.WireError) as e:
                logger.warning("control link from %s refused: %s", peer_address, e)
                link.close()
                continue
            peer = hello.get("rank") if isinstance(hello, dict) else None
            proof = hello.get("token") if isinstance(hello, dict) else None
            if not (isinstance(peer, int) and 0 < peer < world and peer not in links and isinstance(proof, str)
                    and hmac.compare_digest(proof.encode(), token.encode())):
                logger.warning("control link from %s refused: not a rank of this group", peer_address)
                link.close()
                continue
            link.peer, link.timeout_s = peer, timeout_s
            sock.settimeout(timeout_s)
            links[peer] = link
        for link in links.values():
            link.send("ok")
    except BaseException:
        for link in links.values():
            link.close()
        raise
    return links
