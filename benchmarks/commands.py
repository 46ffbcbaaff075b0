"""The table behind `python -m benchmarks <command>`: each command's module and what it measures.

Kept apart from the modules themselves so that listing the commands imports none of them (no torch, no
matplotlib); `benchmarks/__main__.py` imports a command's module only to run it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # exposes main(argv: list[str] | None = None) -> int | None
    summary: str


COMMANDS: tuple[Command, ...] = (
    # against live servers
    Command("serve", "benchmarks.online.serve_bench", "one workload against a running OpenAI-compatible server"),
    Command("ab", "benchmarks.online.ab", "dynamic vs continuous batching (and baselines) on the same workload"),
    Command(
        "priority",
        "benchmarks.online.priority_bench",
        "an interactive class under a saturating batch class: fcfs, priority, priority with preemption",
    ),
    Command(
        "compile-stall",
        "benchmarks.online.compile_stall",
        "a plain request's latency and a stream's longest gap while N hostile grammars compile",
    ),
    Command(
        "tool-routing",
        "benchmarks.online.tool_routing",
        "tool_choice auto per tool-call parser: does the model call the right tool, or answer, on a small set",
    ),
    Command(
        "responses",
        "benchmarks.online.responses_bench",
        "TTFT of turn n of a conversation through previous_response_id against its history resent",
    ),
    Command(
        "prediction",
        "benchmarks.online.prediction_bench",
        "Predicted Outputs at batch 1: decode ms per token with no, a right and a partly right prediction",
    ),
    Command("ray", "benchmarks.online.ray_bench", "what Ray Serve's proxy costs against a plain server"),
    Command("compare", "benchmarks.online.compare_bench", "fairness and event-stream cost of `batchserve compare`"),
    Command(
        "soak",
        "benchmarks.online.soak",
        "a long soak of a real server: memory, descriptors, threads and gauges under mixed load",
    ),
    # peers
    Command("llama-build", "benchmarks.peers.llama_cpp", "build llama-server and the f32 GGUF it is compared on"),
    Command(
        "llama-probe",
        "benchmarks.peers.llama_probe",
        "decode speed at batch 1 and N: batchserve against llama-server on the same weights",
    ),
    Command("vllm-build", "benchmarks.peers.vllm_cpu", "build the venv that vLLM's CPU server runs from"),
    Command(
        "openvino-build",
        "benchmarks.peers.openvino",
        "build the venv OpenVINO GenAI runs from and export the default model to its IR (int4, fp32)",
    ),
    Command(
        "openvino-probe",
        "benchmarks.peers.openvino_probe",
        "batch 1, batch N and a long prompt's TTFT: OpenVINO GenAI against the engine in-process, interleaved",
    ),
    Command("hf-export", "benchmarks.peers.hf_export", "export a GGUF model to a folder `transformers serve` loads"),
    # in-process engine measurements
    Command(
        "engine",
        "benchmarks.micro.engine_bench",
        "engine throughput by batch size against its ceiling and transformers generate()",
    ),
    Command("membw", "benchmarks.micro.membw", "this machine's memory bandwidth by buffer size"),
    Command(
        "quality", "benchmarks.micro.quality", "perplexity and greedy agreement of each weight format against float32"
    ),
    Command(
        "spec-accept",
        "benchmarks.micro.spec_accept",
        "speculative acceptance alone: the per-position loop against the vectorised acceptance",
    ),
    Command(
        "structured",
        "benchmarks.micro.structured_bench",
        "structured outputs: schema compile time, and decode with half the batch constrained against none",
    ),
    Command(
        "tool-cost",
        "benchmarks.micro.tool_grammar_cost",
        "tool_choice auto's lazy grammar: decode with half the batch under it, free and inside a call, against none",
    ),
    Command(
        "formats",
        "benchmarks.micro.format_matrix",
        "every --dtype x --quantization decode step on this CPU, beside auto's choice",
    ),
    Command(
        "busy-start",
        "benchmarks.micro.busy_start",
        "auto's weight-format choice made beside busy processes against a quiet start's, both served quietly",
    ),
    Command("kernels", "benchmarks.micro.kernel_builds", "each quantised kernel in each build this CPU runs"),
    Command("kernel-ab", "benchmarks.micro.kernel_ab", "int4_dot against another commit's kernels, interleaved"),
    # the simulator
    Command("simulate", "benchmarks.sim.cli", "simulated A/B runs: sweep, replay of real traces, max rate"),
    Command("fit-cost", "benchmarks.sim.profiling.cli", "measure this machine's step costs and fit cost.json"),
    Command(
        "spec-break-even",
        "benchmarks.sim.spec_break_even",
        "from a fitted cost model and an acceptance rate: the batch size above which speculation stops paying",
    ),
    Command(
        "sim-requests", "benchmarks.sim.validate.requests", "a real run and its simulated replay, request by request"
    ),
    Command("trace", "benchmarks.sim.validate.export", "(re)write an ab run's workload traces from its raw records"),
    Command(
        "random-checkpoint",
        "benchmarks.sim.profiling.random_checkpoint",
        "random weights of a known shape, to time where real weights can't go",
    ),
    # the comparison page
    Command("screenshot", "benchmarks.page.screenshot", "the README's screenshot: `batchserve compare` in a browser"),
)

BY_NAME: dict[str, Command] = {c.name: c for c in COMMANDS}
