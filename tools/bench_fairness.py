"""FCFS vs Fair (Virtual Token Counter; Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): how evenly do two backlogged sessions get served?

In-process scheduler (no HTTP). Session A sends ``RATIO`` (4) times as many requests as
session B, all the same size (prompt ``PROMPT_LEN`` tokens, ``MAX_TOKENS`` output
tokens, ignore_eos), all queued before the first tick — A's first, so FCFS serves all
of A before any of B. Each tick we record every session's cumulative service::

    service = w_p · prompt tokens computed + w_q · output tokens generated

(the policy's weights, ``fair_prompt_weight`` = 1 and ``fair_output_weight`` = 2;
computed from the requests, so the same yardstick applies to both policies; every
output token counts, including the one sampled from the prefill logits).

A session is *backlogged* while it has a request waiting in ``_pending``; the window is
every tick that starts with both sessions backlogged. Reported per policy: each
session's service at the end of the window, the largest |service(A) − service(B)| at a
tick end inside it, and the paper's bound ``2 · max(w_p · L_input, w_q · M)`` with
``L_input`` = the longest prompt (tokens) and ``M`` = the most tokens a running batch can
hold = ``min(kv_budget_tokens, max_batch_size · (L_input + max_tokens))``; the tighter
variant with ``M = max_tokens`` is reported too. Baseline: FCFS, in the same run.

Usage:
    python tools/bench_fairness.py                        # real SmolLM2, small max_tokens
    python tools/bench_fairness.py --tiny                 # tiny random Llama: seconds
    python tools/bench_fairness.py --tiny --disaggregated # VTC across a prefill and a decode role
    python tools/bench_fairness.py --requests-b 8 --ratio 4 --max-batch-size 4 \\
        --out bench-results/fairness.json --plot bench-results/fairness.png

Prints one JSON summary on stdout (progress on stderr). Every loop is bounded by
``--max-ticks`` and ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import random
import time

import _bench_common as bc


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama from tests/conftest.py")
    ap.add_argument("--requests-b", type=int, default=8, help="requests of session B")
    ap.add_argument("--ratio", type=int, default=4, help="session A sends this many times B's requests")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (both sessions)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--arrival", choices=["a-first", "interleaved"], default="a-first",
                    help="queue all of A then all of B, or alternate A×ratio, B")
    ap.add_argument("--policies", nargs="+", default=["fcfs", "fair"])
    ap.add_argument("--disaggregated", action="store_true",
                    help="a prefill-role and a decode-role scheduler joined in memory (PREFILL_MODE=disaggregated): "
                         "_pending and VTC on the prefill side, decode tokens reported back every tick")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ticks", type=int, default=5000)
    ap.add_argument("--max-seconds", type=float, default=600, help="wall-clock budget for the whole run")
    ap.add_argument("--out", help="also write the JSON summary here")
    ap.add_argument("--plot", help="write a PNG of cumulative service per session, one panel per policy")
    return ap.parse_args(argv)


def engine_config(args, policy: str):
    from shared.config import EngineConfig

    max_len = args.prompt_len + args.max_tokens + 64
    config = EngineConfig(device=args.device, max_model_len=max_len, max_batch_size=args.max_batch_size,
                          policy=policy, seed=args.seed)
    if getattr(args, "disaggregated", False):
        config = EngineConfig(**{**vars(config), "role": "decode"})
    problems = config.problems()
    if problems:
        raise SystemExit("bad configuration: " + "; ".join(problems))
    return config


def service(reqs, w_p: float, w_q: float) -> float:
    """Weighted tokens served to ``reqs`` so far (prompt tokens computed, not cached)."""
    total = 0.0
    for r in reqs:
        prompt_done = min(r.num_computed_tokens, r.prompt_len) - r.num_cached_tokens
        total += w_p * max(0, prompt_done) + w_q * getattr(r, "streamed", r.num_output_tokens)
    return total


def _memory_link(decode):
    """A prefill scheduler's handover sink into ``decode`` in the same process (the wire's
    frame, the KV in a tensor); it takes no more while the decode side holds a batch's
    worth of handovers, as DecodeTargets does."""
    import torch

    def sink(handover, fill) -> bool:
        if len(decode._held) >= decode.max_batch_size:
            return False
        payload = torch.empty(handover.kv_bytes, dtype=torch.uint8)
        fill(payload)
        problem = decode.receive_handover(handover, payload)
        if problem is not None:
            raise RuntimeError(problem)
        return True

    return sink


def run_policy(model, args, policy: str, deadline: bc.Deadline) -> dict:
    from engine_proc.factory import build_scheduler
    from engine_proc.request import RequestStatus

    config = engine_config(args, policy)
    sched = build_scheduler(config, model)
    decode = None
    if args.disaggregated:
        import dataclasses

        sched = build_scheduler(dataclasses.replace(config, role="prefill", decode_engines="memory"), model)
        decode = build_scheduler(config, model)
        sched.handover_sink = _memory_link(decode)
    w_p, w_q = config.fair_prompt_weight, config.fair_output_weight
    rng = random.Random(args.seed)  # same prompts for every policy
    vocab = model.config.vocab_size
    n_a, n_b = args.requests_b * args.ratio, args.requests_b
    sessions = {"A": [bc.make_request(bc.random_prompt(rng, args.prompt_len, vocab), args.max_tokens,
                                      session_id="A", request_id=f"A{i}") for i in range(n_a)],
                "B": [bc.make_request(bc.random_prompt(rng, args.prompt_len, vocab), args.max_tokens,
                                      session_id="B", request_id=f"B{i}") for i in range(n_b)]}
    if args.arrival == "a-first":
        order = sessions["A"] + sessions["B"]
    else:
        order = []
        a, b = iter(sessions["A"]), iter(sessions["B"])
        for _ in range(n_b):
            order += [next(a) for _ in range(args.ratio)] + [next(b)]
    for r in order:
        sched.add_request(r)

    def waiting(s: str) -> int:
        return sum(r.status is RequestStatus.WAITING for r in sessions[s])

    t_start, cpu_start = time.perf_counter(), time.process_time()
    outputs: dict[str, int] = {}
    samples = [{"tick": 0, "t_s": 0.0, "A": 0.0, "B": 0.0, "both_backlogged": True}]
    finish_tick: dict[str, int] = {}
    window_end_tick = 0
    for tick in range(1, args.max_ticks + 1):
        if not sched.has_work() and not (decode is not None and decode.has_work()):
            break
        if deadline.expired():
            bc.log(f"{policy}: out of time after {tick - 1} ticks")
            break
        both = waiting("A") > 0 and waiting("B") > 0
        if both:
            window_end_tick = tick
        outs = sched.step() + (decode.step() if decode is not None else [])
        if decode is not None:  # the decode engine's report (every stats interval; here every tick)
            for session, n in decode.take_session_tokens().items():
                sched.policy.on_tokens_processed(bc.SessionOf(session), 0, n)
        for _, out in outs:
            outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.token_ids)
            if out.finish_reason is not None:
                finish_tick[out.request_id] = tick
        if decode is not None:
            for r in sessions["A"] + sessions["B"]:
                r.streamed = outputs.get(r.request_id, 0)
        samples.append({"tick": tick, "t_s": round(time.perf_counter() - t_start, 4),
                        "A": service(sessions["A"], w_p, w_q), "B": service(sessions["B"], w_p, w_q),
                        "both_backlogged": both})
    for rid in [r.request_id for r in sched.requests()]:  # anything left over if a bound cut the run short
        sched.abort_request(rid)

    window = [s for s in samples if s["tick"] <= window_end_tick]
    end = window[-1]
    max_diff = max(abs(s["A"] - s["B"]) for s in window)
    last = samples[-1]

    def session_stats(s: str) -> dict:
        ticks = [finish_tick[r.request_id] for r in sessions[s] if r.request_id in finish_tick]
        return {"requests": len(sessions[s]), "finished": len(ticks),
                "service_in_window": end[s], "service_total": last[s],
                "mean_finish_tick": round(sum(ticks) / len(ticks), 1) if ticks else None,
                "last_finish_tick": max(ticks) if ticks else None}

    result = {
        "policy": policy,
        "ticks": last["tick"],
        "wall_s": last["t_s"],
        "window_ticks": window_end_tick,
        "window_s": end["t_s"],
        # about torch_threads on a quiet machine; lower when other processes compete
        "cpu_s_per_wall_s": round((time.process_time() - cpu_start) / max(last["t_s"], 1e-9), 3),
        "sessions": {"A": session_stats("A"), "B": session_stats("B")},
        "service_share_B_in_window": bc.ratio(end["B"], end["A"] + end["B"]),
        "max_abs_service_diff_in_window": max_diff,
        "final_service_diff_in_window": end["A"] - end["B"],
        "policy_snapshot": sched.policy.snapshot(),
        "samples": samples,
    }
    bc.log(f"{policy}: window {window_end_tick} ticks, service A {end['A']:.0f} B {end['B']:.0f}, "
           f"max |A-B| {max_diff:.0f}")
    return result


def plot(results: list[dict], bounds: dict, path: str) -> None:
    plt = bc.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 5), sharey=True, squeeze=False)
    for ax, res in zip(axes[0], results):
        xs = [s["t_s"] for s in res["samples"]]
        for sess, color in (("A", "tab:blue"), ("B", "tab:orange")):
            ax.plot(xs, [s[sess] for s in res["samples"]], color=color,
                    label=f"session {sess} ({res['sessions'][sess]['requests']} requests)")
        inside = [s for s in res["samples"] if s["tick"] <= res["window_ticks"]]
        ax.plot([s["t_s"] for s in inside], [abs(s["A"] - s["B"]) for s in inside], color="gray",
                linestyle=":", label="|A − B| while both backlogged")
        ax.axhline(bounds["bound_paper"], color="red", linestyle="--", linewidth=0.9,
                   label=f"bound 2·max(w_p·L, w_q·M) = {bounds['bound_paper']:.0f}")
        ax.axhline(bounds["bound_m_max_tokens"], color="red", linestyle="-.", linewidth=0.7,
                   label=f"same with M = max_tokens: {bounds['bound_m_max_tokens']:.0f}")
        ax.axvspan(0, res["window_s"], color="green", alpha=0.08, label="both backlogged")
        ax.set_title(f"{res['policy']}: max |A−B| while both backlogged = "
                     f"{res['max_abs_service_diff_in_window']:.0f}")
        ax.set_xlabel("seconds")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("cumulative service (w_p·prompt + w_q·output tokens)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    bc.save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.sigterm_as_interrupt()
    env = bc.machine_info("start")
    deadline = bc.Deadline(args.max_seconds)
    base_config = engine_config(args, "fcfs")
    model = bc.load_tiny_model(base_config) if args.tiny else bc.load_real_model(base_config)
    results = []
    for policy in args.policies:
        if deadline.expired():
            bc.log(f"out of time: skipping {policy}")
            continue
        results.append(run_policy(model, args, policy, deadline))

    w_p, w_q = base_config.fair_prompt_weight, base_config.fair_output_weight
    l_input = args.prompt_len
    batch_tokens = min(base_config.resolved_kv_budget_tokens,
                       args.max_batch_size * (l_input + args.max_tokens))
    bounds = {
        "w_p": w_p, "w_q": w_q, "L_input": l_input,
        "M_paper": batch_tokens,
        "M_definition": "most tokens a running batch can hold: "
                        "min(kv_budget_tokens, max_batch_size * (L_input + max_tokens))",
        "bound_paper": 2 * max(w_p * l_input, w_q * batch_tokens),
        "bound_m_max_tokens": 2 * max(w_p * l_input, w_q * args.max_tokens),
    }
    base = results[0] if results else None
    comparison = {}
    for res in results[1:]:
        comparison[res["policy"]] = {
            "max_abs_service_diff_ratio": bc.ratio(res["max_abs_service_diff_in_window"],
                                                   base["max_abs_service_diff_in_window"]),
            "service_share_B_in_window": res["service_share_B_in_window"],
            "B_mean_finish_tick_ratio": bc.ratio(res["sessions"]["B"]["mean_finish_tick"],
                                                 base["sessions"]["B"]["mean_finish_tick"]),
        }
    for res in results:
        res["within_bound_paper"] = res["max_abs_service_diff_in_window"] <= bounds["bound_paper"]
        res["within_bound_m_max_tokens"] = res["max_abs_service_diff_in_window"] <= bounds["bound_m_max_tokens"]
    summary = {
        "benchmark": "fairness",
        "baseline": f"{base['policy'] if base else None} (same run)",
        "model": "tiny random Llama" if args.tiny else "SmolLM2-135M-Instruct (or --model)",
        "workload": {"requests_A": args.requests_b * args.ratio, "requests_B": args.requests_b,
                     "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "max_batch_size": args.max_batch_size, "arrival": args.arrival,
                     "prefill_mode": base_config.resolved_prefill_mode.value,
                     "layout": "1 prefill + 1 decode scheduler (in memory)" if args.disaggregated else "one engine",
                     "prefill_chunk_size": base_config.prefill_chunk_size},
        "service_definition": "w_p * prompt tokens computed (not cached) + w_q * output tokens",
        "backlogged_definition": "a session with at least one request waiting in _pending at the "
                                 "start of a tick; the window is every tick that starts with both",
        "bounds": bounds,
        "env": {**env, **bc.machine_info("end"), **bc.torch_info()},
        "vs_baseline": comparison,
        "policies": results,
    }
    if args.plot and results:
        plot(results, bounds, args.plot)
    bc.emit(summary, args.out)
    return 0


if __name__ == "__main__":
    bc.run_main(main)
