"""Workload traces: what a server saw, one request a line, for the simulator to replay.

    {"arrival_s": 0.0, "prompt_tokens": 57, "max_tokens": 200, "output_tokens": 200}

`arrival_s` is seconds after the run started; `output_tokens` (optional) is how many tokens the request produced:
below `max_tokens` it replays a natural stop (EOS). A trace comes from a real run (`python -m benchmarks ab
--export-workload`, or `python -m benchmarks trace` afterwards) or is synthesised from the same workload and arrival
generators the A/B command uses.

Optional prefix identity, for the simulator's prefix cache: `"prefix_id": "system", "prefix_tokens": 555` (the
prompt starts with the first 555 tokens of the prefix named "system", shared with every line naming it), or
`"follows": 3` (a conversation's next turn: sent once the file's request 3, counted from 0, has finished, its
prompt being that request's prompt and answer, then its own tokens; `arrival_s` is then the earliest it may
arrive). Without them a line shares no token with another. Synthesised multi-turn and shared-prefix traces carry
them; traces exported from real runs do not yet.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.loadgen.arrivals import ArrivalConfig, arrival_offsets
from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.run import RunResult
from benchmarks.loadgen.workloads import RequestSpec, WorkloadConfig, build_workload


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int | None = None
    prefix_id: str | None = None  # the prompt starts with this shared prefix's first prefix_tokens tokens
    prefix_tokens: int = 0
    follows: int | None = None  # index of the earlier request whose prompt and answer this prompt starts with

    def __post_init__(self) -> None:
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError(f"prompt_tokens and max_tokens must be >= 1, got {self.prompt_tokens}, {self.max_tokens}")
        if self.output_tokens is not None and not 1 <= self.output_tokens <= self.max_tokens:
            raise ValueError(f"output_tokens must be in 1..max_tokens ({self.max_tokens}), got {self.output_tokens}")
        if (self.prefix_id is None) != (self.prefix_tokens == 0) or not 0 <= self.prefix_tokens <= self.prompt_tokens:
            got = f"{self.prefix_id!r}, {self.prefix_tokens}"
            raise ValueError(f"prefix_id and prefix_tokens (1..prompt_tokens) go together, got {got}")
        if self.follows is not None and (self.follows < 0 or self.prefix_id is not None):
            raise ValueError(f"follows must be an earlier line's index >= 0, without a prefix_id, got {self.follows}")

    def to_json(self) -> dict[str, float | int | str]:
        row: dict[str, float | int | str] = {
            "arrival_s": round(self.arrival_s, 6),
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
        }
        if self.output_tokens is not None:
            row["output_tokens"] = self.output_tokens
        if self.prefix_id is not None:
            row["prefix_id"], row["prefix_tokens"] = self.prefix_id, self.prefix_tokens
        if self.follows is not None:
            row["follows"] = self.follows
        return row


def write_trace(requests: Iterable[TraceRequest], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests))
    return path


def read_trace(path: Path) -> list[TraceRequest]:
    """Requests sorted by arrival (`follows` renumbered to match); a bad line is a ValueError naming it."""
    requests: list[TraceRequest] = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            output, prefix, follows = row.get("output_tokens"), row.get("prefix_id"), row.get("follows")
            if prefix is not None and not isinstance(prefix, str):
                raise ValueError(f"prefix_id must be a string, got {prefix!r}")
            if follows is not None and not 0 <= _int(follows) < len(requests):
                raise ValueError(f"follows must name an earlier line (0..{len(requests) - 1}), got {follows}")
            requests.append(
                TraceRequest(
                    float(row["arrival_s"]),
                    _int(row["prompt_tokens"]),
                    _int(row["max_tokens"]),
                    None if output is None else _int(output),
                    prefix,
                    _int(row.get("prefix_tokens", 0)),
                    follows,
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{line_no}: {exc}") from exc
    if not requests:
        raise ValueError(f"{path} has no requests")
    return sort_by_arrival(requests)


def sort_by_arrival(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The requests in arrival order (ties keep their order), each `follows` pointing at the same request after."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    position = {old: new for new, old in enumerate(order)}
    moved = []
    for old in order:
        r = requests[old]
        if r.follows is not None:
            if requests[r.follows].arrival_s > r.arrival_s:
                raise ValueError(f"request {old} follows request {r.follows}, which arrives after it")
            r = replace(r, follows=position[r.follows])
        moved.append(r)
    return moved


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def synthesize(workload: WorkloadConfig, arrivals: ArrivalConfig) -> list[TraceRequest]:
    """The requests `benchmarks.online.ab` would send with these flags, at the times it would send them. Prompt lengths
    are the generator's estimate (about one token a word); every request runs to max_tokens, as with
    --ignore-eos."""
    specs = build_workload(workload)
    offsets = arrival_offsets(arrivals, len(specs))
    trace: list[TraceRequest] = []
    for spec, offset in zip(specs, offsets, strict=True):
        prompt_tokens = max(1, spec.prompt_tokens)
        if spec.follows is not None:  # sent when the previous turn ends: no earlier than it
            leader = trace[spec.follows].arrival_s
            trace.append(TraceRequest(leader, prompt_tokens, spec.max_tokens, follows=spec.follows))
        elif spec.prefix is not None:
            name, tokens = spec.prefix
            trace.append(TraceRequest(offset, prompt_tokens, spec.max_tokens, None, name, min(tokens, prompt_tokens)))
        else:
            trace.append(TraceRequest(offset, prompt_tokens, spec.max_tokens))
    return trace


def _stamp(record: RequestRecord) -> float | None:
    stamp = (record.server_timings or {}).get("arrival_time")
    return float(stamp) if record.ok and isinstance(stamp, (int, float)) else None


def server_arrivals(records: Sequence[RequestRecord]) -> list[float]:
    """When each request reached the server's queue, on the run's clock (seconds after it started).

    Requests sent at once do not reach the queue in the order they were sent: measured, 48 requests sent within
    8 ms were admitted starting with the 31st. Replaying send order would seat different requests first (and
    with long and short answers mixed, change every latency), so the server's order is the one to replay. The
    server stamps it (`timings.arrival_time`, Unix seconds); the stamps keep their spacing and are placed so the
    first falls at the earliest stamped request's send time. A request without a stamp (failed, or a server
    that does not report one) keeps its send time.
    """
    stamps = [_stamp(r) for r in records]
    stamped = [(r.send_time, s) for r, s in zip(records, stamps, strict=True) if s is not None]
    if not stamped:
        return [max(0.0, r.send_time) for r in records]
    origin, start = min(s for _, s in stamped), min(t for t, _ in stamped)
    return [max(0.0, r.send_time if s is None else start + (s - origin)) for r, s in zip(records, stamps, strict=True)]


def replay_order(records: Sequence[RequestRecord]) -> list[tuple[float, RequestRecord]]:
    """Each request with its arrival at the server (`server_arrivals`), in the order the server received them: a
    trace's order, so the n-th record here is the n-th request of the trace and of its simulated replay."""
    return sorted(zip(server_arrivals(records), records, strict=True), key=lambda p: (p[0], p[1].index))


def trace_prompt_tokens(record: RequestRecord) -> int:
    """A real request's prompt length as its trace line holds it (at least one token)."""
    return max(1, record.counted_prompt_tokens)


def from_records(records: Sequence[RequestRecord], specs: Sequence[RequestSpec] = ()) -> list[TraceRequest]:
    """A real run as a trace: each request's arrival at the server (`server_arrivals`), the server's token counts
    (usage) where reported, and the tokens it produced. Failed requests are kept with their asked-for lengths:
    they arrived too. `specs`, the workload the run sent: what each request shares with others (a named prefix, or
    the conversation turn it follows), so that a replay's prefix cache finds what the server's found."""
    ordered = replay_order(records)
    position = {r.index: i for i, (_, r) in enumerate(ordered)}
    by_index = {spec.index: spec for spec in specs}
    trace: list[TraceRequest] = []
    for arrival, r in ordered:
        output = r.output_tokens if r.ok and 1 <= r.output_tokens <= r.max_tokens else None
        prompt_tokens = trace_prompt_tokens(r)
        spec = by_index.get(r.index)
        if spec is not None and spec.follows is not None and spec.follows in position:
            trace.append(TraceRequest(arrival, prompt_tokens, r.max_tokens, output, follows=position[spec.follows]))
        elif spec is not None and spec.prefix is not None:
            name, tokens = spec.prefix
            trace.append(TraceRequest(arrival, prompt_tokens, r.max_tokens, output, name, min(tokens, prompt_tokens)))
        else:
            trace.append(TraceRequest(arrival, prompt_tokens, r.max_tokens, output))
    return trace


def at_once(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The same requests, all arriving at time 0 in the trace's order."""
    return [replace(request, arrival_s=0.0) for request in trace]


# ----- a benchmarks.online.ab run's traces, one file per run: OUT/workload/<mode>.jsonl and <mode>@<rate>.jsonl -----
def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def export_runs(
    out_dir: Path,
    runs: Mapping[str, RunResult],
    sweep: Mapping[str, Sequence[RunResult]],
    specs: Sequence[RequestSpec] = (),
) -> Path:
    """`specs`: the workload every run sent, whose shared prefixes and conversation turns the traces keep."""
    folder = out_dir / "workload"
    for name, run in runs.items():
        write_trace(from_records(run.records, specs), folder / f"{name}.jsonl")
    for name, sweep_runs in sweep.items():
        for run in sweep_runs:
            write_trace(from_records(run.records, specs), folder / f"{name}@{_rate_label(run.request_rate)}.jsonl")
    return folder


@dataclass(frozen=True)
class ExportedRuns:
    main: dict[str, list[TraceRequest]]  # run name -> its trace
    sweep: dict[str, dict[float, list[TraceRequest]]]  # run name -> rate -> its trace


def read_exported(folder: Path) -> ExportedRuns:
    """What `export_runs` wrote (give the run's --out folder or its workload/ folder)."""
    folder = folder / "workload" if (folder / "workload").is_dir() else folder
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise ValueError(f"no workload traces (*.jsonl) in {folder}; run benchmarks.online.ab with --export-workload")
    exported = ExportedRuns({}, {})
    for path in files:
        name, _, rate = path.stem.partition("@")
        if rate:
            exported.sweep.setdefault(name, {})[float(rate)] = read_trace(path)
        else:
            exported.main[name] = read_trace(path)
    return exported
