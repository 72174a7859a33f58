"""The PMI-1 text protocol of MPICH's simple PMI client: parsing, formatting, the limits.

:class:`~spark_estimators.driver.pmi.PMIServer` speaks it to the ranks.

Protocol, one ``cmd=<name> key=value ...`` line per message (client -> server -> client)::

    initack pmiid=T      -> initack rc=0, then set size=N / set rank=R / set debug=0
    init pmi_version=1   -> response_to_init rc=0 pmi_version=1 pmi_subversion=1
    get_maxes            -> maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024
    get_appnum           -> appnum rc=0 appnum=0
    get_universe_size    -> universe_size rc=0 size=N
    get_my_kvsname       -> my_kvsname rc=0 kvsname=K
    put kvsname key value-> put_result rc=0
    get kvsname key      -> get_result rc=0 found=TRUE value=V   (unknown key: rc=-1)
    barrier_in           -> barrier_out rc=0, to every rank once all N have entered
    finalize             -> finalize_ack rc=0
    abort exitcode msg   -> (no answer; reported as a failure of that rank)
"""

from __future__ import annotations

from collections.abc import Sequence

KVSNAME_MAX = 256
KEYLEN_MAX = 64
VALLEN_MAX = 1024
MAX_LINE = 4096  # MPICH's client never sends more than 1024 bytes per line
MAPPING_KEY = "PMI_process_mapping"


def process_mapping(nodes: Sequence[str]) -> str:
    """MPICH's ``PMI_process_mapping`` for ``nodes[r]`` = the node (host) key of rank ``r``.

    The format is ``(vector,(first_node,node_count,ranks_per_node),...)``: each block gives
    ``ranks_per_node`` consecutive ranks to each of ``node_count`` consecutive nodes. Ranks that
    share a node are what MPICH puts on shared memory.

    >>> process_mapping(["a", "a", "b", "b"])
    '(vector,(0,2,2))'
    >>> process_mapping(["a", "b", "b"])
    '(vector,(0,1,1),(1,1,2))'
    """
    ids: dict[str, int] = {}
    runs: list[tuple[int, int]] = []  # (node id, consecutive ranks on it)
    for node in nodes:
        node_id = ids.setdefault(node, len(ids))
        if runs and runs[-1][0] == node_id:
            runs[-1] = (node_id, runs[-1][1] + 1)
        else:
            runs.append((node_id, 1))
    blocks: list[list[int]] = []  # [first node, node count, ranks per node]
    for node_id, count in runs:
        last = blocks[-1] if blocks else None
        if last is not None and last[2] == count and last[0] + last[1] == node_id:
            last[1] += 1
        else:
            blocks.append([node_id, 1, count])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


def parse_command(line: str) -> tuple[str, dict[str, str]]:
    r"""Split one PMI-1 line into the command and its ``key=value`` pairs (values kept raw).

    A backslash escapes the next character (MPICH's parser rule), so an escaped space stays
    inside its value.

    >>> parse_command(r"cmd=put kvsname=k key=a value=x\ y")
    ('put', {'kvsname': 'k', 'key': 'a', 'value': 'x\\ y'})
    """
    tokens: list[str] = []
    current: list[str] = []
    escaped = False
    for ch in line.rstrip("\n"):
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            current.append(ch)
            escaped = True
        elif ch == " ":
            if current:
                tokens.append("".join(current))
                current = []
        else:
            current.append(ch)
    if current:
        tokens.append("".join(current))
    if not tokens or not tokens[0].startswith("cmd="):
        raise ValueError(f"not a PMI-1 command: {line[:80]!r}")
    args: dict[str, str] = {}
    for token in tokens[1:]:
        key, _, value = token.partition("=")
        args[key] = value
    return tokens[0][4:], args


def format_command(cmd: str, **args: object) -> bytes:
    """One PMI-1 response line, ``cmd=<cmd> k=v ...`` and a newline."""
    parts = [f"cmd={cmd}"] + [f"{k}={v}" for k, v in args.items()]
    return (" ".join(parts) + "\n").encode()
