"""Split a generate run's wall time per engine step into device and host time.

For the measured run the runner waits for each graph to finish before the host goes on
(`serialize_graphs`), so executions never overlap host work or each other: the runtime's
execution time (torch_xla's `ExecuteTime` metric; on the jax runtime the time the host
waited for each launched graph) then adds up to the device time, and the rest of the wall
time is host time (scheduling, input preparation, graph lookup or lazy tracing, transfers,
output handling). The lost overlap makes the step a little slower than in serving.
"""

from __future__ import annotations

import collections
import time


def timed(llm, fn) -> dict:
    """Run fn() (a generate call on `llm`) and return timing fields for a JSON row; the
    call's result is under "_result"."""
    engine = llm.llm_engine
    engine.runner.serialize_graphs = True
    steps0, (n0, ns0) = engine.num_steps, engine.runtime.execution_stats()
    graphs0 = collections.Counter(engine.runner.forward_graph_steps)
    t0 = time.perf_counter()
    try:
        result = fn()
    finally:
        engine.runner.serialize_graphs = False
    elapsed = time.perf_counter() - t0
    steps, (n1, ns1) = max(engine.num_steps - steps0, 1), engine.runtime.execution_stats()
    device_ms = (ns1 - ns0) / 1e6 / steps
    graphs = collections.Counter(engine.runner.forward_graph_steps)
    graphs.subtract(graphs0)
    step_ms = 1e3 * elapsed / steps
    return {"elapsed_s": elapsed, "steps": steps, "ms_per_step": step_ms,
            "device_ms_per_step": device_ms, "host_ms_per_step": step_ms - device_ms,
            "executions_per_step": (n1 - n0) / steps,
            # The run's steps per forward graph, "T<tokens>/S<slots>/<LoRA strategy>".
            "forward_graph_steps": {k: n for k, n in sorted(graphs.items()) if n},
            "_result": result}


def timed_generate(llm, work, lora_request=None, keep_outputs: bool = False) -> dict:
    """Greedy generate of `work` ([(prompt token ids, output length)], ignore_eos) on
    `llm`, timed by `timed`: a JSON row of its timing fields plus requests/s and output
    tokens/s; keep_outputs adds each request's token ids under "outputs"."""
    from vllm_tpu_lora import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in work]
    row = timed(llm, lambda: llm.generate(prompts, params, lora_request=lora_request,
                                          use_tqdm=False))
    outputs = [o.outputs[0].token_ids for o in row.pop("_result")]
    n_out = sum(map(len, outputs))
    row = {"requests_per_s": len(work) / row["elapsed_s"],
           "output_tokens_per_s": n_out / row["elapsed_s"], **row, "output_tokens": n_out}
    return {**row, "outputs": outputs} if keep_outputs else row
