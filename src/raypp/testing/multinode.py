"""Run raypp across a multi-node Ray cluster simulated on one machine.

``python -m raypp.testing.multinode MODEL_DIR [--kill-remote] [--soak-s N]``
starts a head node and one extra node (``ray.cluster_utils.Cluster``, each with
its own raylet), places one stage per node (``STRICT_SPREAD``), generates, and
prints one JSON line with the stages' node ids, the tokens, and (optionally)
what happened when the remote node's stage was killed or during a soak.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt-ids", default="1,2,3;4,5,6,7,8")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kill-remote", action="store_true")
    parser.add_argument("--soak-s", type=float, default=0.0)
    args = parser.parse_args()
    os.environ["RAYPP_PLACEMENT_STRATEGY"] = "STRICT_SPREAD"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from raypp import envs

    envs.apply_ray_cgraph_env()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    report: dict = {}
    try:
        report = _run(args, ray)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(report))


def _run(args: argparse.Namespace, ray) -> dict:
    from raypp import LLM, RequestFailedError, SamplingParams

    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids.split(";")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    report: dict = {}
    with LLM(args.model, pipeline_parallel_size=2, max_restarts=5) as llm:
        executor = llm.engine.executor
        report["nodes"] = ray.get([w.node_id.remote() for w in executor.all_workers])
        report["head_node"] = ray.get_runtime_context().get_node_id()
        report["tokens"] = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
        if args.kill_remote:
            remote = next(i for i, n in enumerate(report["nodes"]) if n != report["head_node"])
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            victim = executor.all_workers[remote]
            import threading

            killed_at: list[float] = []

            def kill() -> None:
                time.sleep(1.0)
                killed_at.append(time.monotonic())
                ray.kill(victim, no_restart=True)

            threading.Thread(target=kill, daemon=True).start()
            try:
                llm.generate(inputs * 3, long, use_tqdm=False)
                report["kill_error"] = None
            except RequestFailedError as e:
                report["kill_error"] = str(e)
                report["kill_to_error_s"] = time.monotonic() - killed_at[0]
            report["after_kill_tokens"] = [o.outputs[0].token_ids
                                           for o in llm.generate(inputs, params, use_tqdm=False)]
            report["nodes_after_kill"] = ray.get([w.node_id.remote()
                                                  for w in llm.engine.executor.all_workers])
        if args.soak_s > 0:
            report["soak"] = _soak(llm, inputs, args.soak_s)
    return report


def _soak(llm, inputs, seconds: float) -> dict:
    from raypp import SamplingParams

    params = SamplingParams(temperature=0.8, max_tokens=64, seed=1, ignore_eos=True)
    steps_before = llm.engine.stats.steps
    errors, longest, batches = 0, 0.0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            llm.generate(inputs * 4, params, use_tqdm=False)
        except Exception:  # noqa: BLE001 - counted, the soak goes on
            errors += 1
        longest = max(longest, time.monotonic() - started)
        batches += 1
    return {"seconds": seconds, "batches": batches, "steps": llm.engine.stats.steps - steps_before,
            "errors": errors, "longest_batch_s": longest, "restarts": llm.engine.restarts,
            "longest_step_wait_s": llm.engine.stats.max_step_wait_s}


if __name__ == "__main__":
    main()
