"""``torchmp run`` inside a Slurm allocation: the job's shape from its
environment, so a multi-node job needs no hand-written ``MASTER_ADDR``.

Slurm starts one ``torchmp run`` per node (``srun --ntasks-per-node=1``);
each reads

======================================  =====================================
``--nnodes``                            ``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``)
``--node-rank``                         ``SLURM_NODEID``
``--master-addr``                       the first host of ``SLURM_STEP_NODELIST``
                                        (inside ``srun``), else of
                                        ``SLURM_JOB_NODELIST``, expanded here
                                        (no ``scontrol`` needed)
``--master-port``                       15000 + the last 4 digits of
                                        ``SLURM_JOB_ID`` (PyTorch Lightning's
                                        rule: the same on every node, below
                                        Linux's ephemeral port range)
``-n``                                  ``SLURM_GPUS_ON_NODE``, else
                                        ``SLURM_NTASKS_PER_NODE``
======================================  =====================================

Node lists use Slurm's hostlist syntax: ``gpu[01-04,07],cpu3`` is
``gpu01 gpu02 gpu03 gpu04 gpu07 cpu3`` (zero padding kept, several bracket
groups in one name expand as a product).
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["Allocation", "SlurmError", "allocation", "count_hosts", "expand_hostlist", "first_host"]

#: Base of the derived rendezvous port.
PORT_BASE = 15000

_DIGITS = re.compile(r"[0-9]+")


class SlurmError(ValueError):
    """A Slurm variable torchmp needs cannot be read."""


# A host name: literal text and bracket groups, each a list of (first, last, width).
_Range = tuple[int, int, int]
_Part = str | list[_Range]


def _parse_group(body: str, where: str) -> list[_Range]:
    ranges: list[_Range] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not _DIGITS.fullmatch(lo) or sep and not _DIGITS.fullmatch(hi):
            raise SlurmError(f"{where}: [{body}] holds {item!r}, which is not a number or a range like 01-04")
        first = int(lo)
        last = int(hi) if sep else first
        if last < first:
            raise SlurmError(f"{where}: the range {item!r} in [{body}] runs backwards")
        ranges.append((first, last, len(lo)))
    return ranges


def _parse_host(text: str, where: str) -> list[_Part]:
    parts: list[_Part] = []
    pos = 0
    while pos < len(text):
        open_at = text.find("[", pos)
        close_at = text.find("]", pos)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            raise SlurmError(f"{where}: ']' without '[' in {text!r}")
        if open_at == -1:
            parts.append(text[pos:])
            break
        if open_at > pos:
            parts.append(text[pos:open_at])
        if close_at == -1:
            raise SlurmError(f"{where}: '[' without ']' in {text!r}")
        body = text[open_at + 1:close_at]
        if "[" in body:
            raise SlurmError(f"{where}: nested '[' in {text!r}")
        if not body:
            raise SlurmError(f"{where}: empty [] in {text!r}")
        parts.append(_parse_group(body, where))
        pos = close_at + 1
    return parts


def _split_top(text: str, where: str) -> list[str]:
    """Split at the commas (and blanks) outside brackets."""
    items: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"{where}: ']' without '[' in {text!r}")
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    if depth:
        raise SlurmError(f"{where}: '[' without ']' in {text!r}")
    items.append("".join(current))
    return items


def _parse(text: str, where: str) -> list[list[_Part]]:
    hosts = []
    for item in _split_top(text.strip(), where):
        if not item:
            if text.strip():
                raise SlurmError(f"{where}: empty host name in {text!r}")
            raise SlurmError(f"{where} is empty")
        hosts.append(_parse_host(item, where))
    return hosts


def _names(parts: list[_Part]) -> Iterator[str]:
    """The names a parsed host stands for, first bracket group slowest."""
    if not parts:
        yield ""
        return
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        for tail in _names(rest):
            yield head + tail
        return
    for first, last, width in head:
        for n in range(first, last + 1):
            for tail in _names(rest):
                yield f"{n:0{width}d}{tail}"


def expand_hostlist(text: str, where: str = "host list", limit: int = 1 << 16) -> list[str]:
    """Every host of a Slurm host list, in order (at most ``limit``).

    >>> expand_hostlist("gpu[01-03,07],cpu3")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu3']
    """
    out: list[str] = []
    for parts in _parse(text, where):
        for name in _names(parts):
            if len(out) >= limit:
                raise SlurmError(f"{where}: more than {limit} hosts in {text!r}")
            out.append(name)
    return out


def first_host(text: str, where: str = "host list") -> str:
    """The first host of a host list (the whole list is checked)."""
    hosts = _parse(text, where)
    return next(_names(hosts[0]))


def count_hosts(text: str, where: str = "host list") -> int:
    total = 0
    for parts in _parse(text, where):
        count = 1
        for part in parts:
            if isinstance(part, list):
                count *= sum(last - first + 1 for first, last, _ in part)
        total += count
    return total


@dataclass
class Allocation:
    """What ``torchmp run`` takes from the Slurm job it runs in."""

    job_id: str
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: int | None = None
    #: (option, value, where it came from), for the message saying so.
    derived: list[tuple[str, str, str]] = field(default_factory=list)

    def describe(self) -> str:
        shown = ", ".join(f"{opt} {value} ({source})" for opt, value, source in self.derived)
        return f"Slurm job {self.job_id}: {shown}" if shown else ""


def _positive(environ: Mapping[str, str], name: str, minimum: int = 1) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or int(text) < minimum:
        floor = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise SlurmError(f"{name}={raw!r} is not {floor}")
    return int(text)


def allocation(environ: Mapping[str, str], *, rendezvous: bool, nproc: bool) -> Allocation | None:
    """The job's shape from ``environ``, or None outside Slurm (no
    ``SLURM_JOB_ID``).  ``rendezvous``: derive nnodes, node rank, master
    address and port (the user gave none of them); ``nproc``: derive ``-n``.
    A variable that is needed and malformed is a :class:`SlurmError`."""
    job_id = (environ.get("SLURM_JOB_ID") or "").strip()
    if not job_id:
        return None
    alloc = Allocation(job_id)
    if nproc:
        for name in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
            value = _positive(environ, name)
            if value is not None:
                alloc.nproc = value
                alloc.derived.append(("-n", str(value), name))
                break
    if not rendezvous:
        return alloc
    name = "SLURM_NNODES" if environ.get("SLURM_NNODES") else "SLURM_JOB_NUM_NODES"
    nnodes = _positive(environ, name)
    if nnodes is None:
        raise SlurmError("SLURM_JOB_ID is set but SLURM_NNODES is not: pass --nnodes, --node-rank, "
                         "--master-addr and --master-port (or --no-slurm)")
    if nnodes == 1:
        # One node: the ranks meet on this host, on a free port, exactly as
        # without Slurm (a fixed port would collide between runs in the job).
        alloc.derived.append(("--nnodes", "1", name))
        alloc.nnodes, alloc.node_rank = 1, 0
        return alloc
    node_rank = _positive(environ, "SLURM_NODEID", minimum=0)
    if node_rank is None:
        raise SlurmError("SLURM_NNODES > 1 but SLURM_NODEID is not set: start torchmp run with "
                         "srun --ntasks-per-node=1, one per node")
    if node_rank >= nnodes:
        raise SlurmError(f"SLURM_NODEID={node_rank} is not below {name}={nnodes}")
    list_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if environ.get(v)), None)
    if list_var is None:
        raise SlurmError("SLURM_JOB_NODELIST is not set: pass --master-addr")
    nodelist = environ[list_var]
    where = f"{list_var}={nodelist!r}"
    master = first_host(nodelist, where)
    if count_hosts(nodelist, where) < nnodes:
        raise SlurmError(f"{where} names fewer hosts than {name}={nnodes}")
    if not job_id.isascii() or not job_id.isdigit():
        raise SlurmError(f"SLURM_JOB_ID={job_id!r} is not a number: pass --master-port")
    port = PORT_BASE + int(job_id[-4:])
    alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port = nnodes, node_rank, master, port
    alloc.derived += [
        ("--nnodes", str(nnodes), name),
        ("--node-rank", str(node_rank), "SLURM_NODEID"),
        ("--master-addr", master, f"first host of {list_var}"),
        ("--master-port", str(port), "SLURM_JOB_ID"),
    ]
    return alloc
