"""Run raypp across a multi-node Ray cluster simulated on one machine.

``python -m raypp.testing.multinode MODEL_DIR [--kill-remote] [--lose-node S] [--soak-s N]``
starts a head node and one extra node (``ray.cluster_utils.Cluster``, each with
its own raylet), places one stage per node (``STRICT_SPREAD``), generates, and
prints one JSON line with the stages' node ids, the tokens, and (optionally)
what happened when the remote node's stage was killed or during a soak.

``--kill-remote`` kills the remote stage between requests: killing a stage in
the middle of a cross-node step can crash a raylet (a Ray bug,
ray-project/ray#63229), which no engine can heal from the inside; mid-step
kills are tested on one node (``tests/test_faults.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt-ids", default="1,2,3;4,5,6,7,8")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kill-remote", action="store_true")
    parser.add_argument("--lose-node", type=float, default=0.0, metavar="S",
                        help="then remove the worker node, and add a fresh one S s later")
    parser.add_argument("--soak-s", type=float, default=0.0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        # a lost node is declared dead after ~3 s rather than ~15 s
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
    })
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    report: dict = {}
    try:
        report = _run(args, ray, cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(report))


def _run(args: argparse.Namespace, ray, cluster) -> dict:
    from raypp import LLM, SamplingParams
    from raypp.testing import wait_suspended

    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids.split(";")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    report: dict = {}
    with LLM(args.model, pipeline_parallel_size=2, max_restarts=5,
             placement_strategy="STRICT_SPREAD") as llm:
        executor = llm.engine.executor
        report["nodes"] = ray.get([w.node_id.remote() for w in executor.all_workers])
        report["head_node"] = ray.get_runtime_context().get_node_id()
        report["tokens"] = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
        if args.kill_remote:
            remote = next(i for i, n in enumerate(report["nodes"]) if n != report["head_node"])
            wait_suspended(executor)
            ray.kill(executor.all_workers[remote], no_restart=True)
            report["after_kill_tokens"] = [o.outputs[0].token_ids
                                           for o in llm.generate(inputs, params, use_tqdm=False)]
            report["restarts"] = llm.engine.restarts
            report["nodes_after_kill"] = ray.get([w.node_id.remote()
                                                  for w in llm.engine.executor.all_workers])
        if args.lose_node:
            wait_suspended(llm.engine.executor)
            cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
            lost_at = time.monotonic()
            outs: list = []
            request = threading.Thread(target=lambda: outs.extend(
                llm.generate(inputs, params, use_tqdm=False)))
            request.start()  # it waits for a node; Ray adds nodes from the main thread only
            time.sleep(args.lose_node)
            cluster.add_node(num_cpus=1)
            request.join()
            report["after_node_loss_tokens"] = [o.outputs[0].token_ids for o in outs]
            report["node_loss_to_tokens_s"] = time.monotonic() - lost_at
            report["restarts_after_node_loss"] = llm.engine.restarts
            report["nodes_after_node_loss"] = ray.get([w.node_id.remote()
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
