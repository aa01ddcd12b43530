"""`kvtier bench serve`: the KV memory of each run, the figures and their medians, texts matched by
prompt, the client's command line as vLLM's own parser reads it, the JSON merged into kvtier-bench.json,
and (e2e) a `--quick` run end to end against vLLM's OpenAI server on the CPU build."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from kvtier.app import cli
from kvtier.bench import all as bench_all
from kvtier.bench import serve
from kvtier.bench.seaweed import ObjectStore
from kvtier.bench.serve_plan import (
    RUNS,
    RunResult,
    Workload,
    by_prompt,
    count_matches,
    hit_fractions,
    median,
    ratio,
    run_order,
    size_kv,
    spread,
    summarize,
)
from tests.support.warm import WarmProcess, start_server


# ------------------------------------------------------------------------------ sizing
def test_default_workload_sizes_the_constrained_memory_for_its_concurrency_and_the_ceiling_for_all() -> None:
    w = Workload()
    assert (w.num_prompts, w.max_model_len) == (128, 1120)  # 1072 tokens at most, plus one block
    sizing = size_kv(w)
    assert sizing.prefix_blocks == 32
    assert sizing.constrained_blocks == 4 * 35 + 1  # four requests of 35 blocks, and the null block
    # 16 prefixes of 32 blocks, 128 requests' own 3 blocks each, and the null block.
    assert sizing.ceiling_blocks == 16 * 32 + 128 * 3 + 1
    assert sizing.prefixes_in_constrained == 4


def test_quick_workload_leaves_most_prefixes_out_of_the_constrained_memory() -> None:
    sizing = size_kv(serve.QUICK)
    assert (sizing.constrained_blocks, sizing.ceiling_blocks) == (2 * 11 + 1, 8 * 8 + 16 * 3 + 1)
    assert sizing.prefixes_in_constrained == 2


def test_a_workload_whose_prefixes_all_fit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"all 4 prefixes fit .* raise num_prefixes above 4"):
        size_kv(Workload(num_prefixes=4, concurrency=4))


def test_a_prefix_shorter_than_a_block_is_refused() -> None:
    with pytest.raises(ValueError, match=r"prefix_len \(16\) must be at least one block \(32 tokens\)"):
        size_kv(Workload(prefix_len=16))


@pytest.mark.parametrize("field", ["prefix_len", "suffix_len", "output_len", "num_prefixes", "concurrency"])
def test_workload_fields_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be at least 1, got 0"):
        Workload(**{field: 0})


def test_each_configuration_takes_each_place_in_turn() -> None:
    orders = [run_order(i) for i in range(4)]
    assert orders[0] == RUNS == ("prefix_cache", "kvtier", "ceiling")
    assert orders[1] == ("kvtier", "ceiling", "prefix_cache")
    assert orders[2] == ("ceiling", "prefix_cache", "kvtier")
    assert orders[3] == orders[0]


# ------------------------------------------------------------------------------ figures
def test_median_spread_and_ratio() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 4.0]) == 2.5
    assert spread([3.0, 1.0, 2.0]) == [1.0, 3.0]
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(2.0, 3.0) == 0.667
    with pytest.raises(ValueError, match="non-positive"):
        ratio(1.0, 0.0)
    with pytest.raises(ValueError, match="median of no values"):
        median([])


def test_texts_are_matched_by_prompt_not_by_position() -> None:
    reference = by_prompt(["a", "b", "c"], ["x", "y", "z"])
    assert count_matches(["c", "a", "b"], ["z", "x", "q"], reference) == 2
    assert count_matches(["d"], ["x"], reference) == 0
    with pytest.raises(ValueError, match="2 prompts but 1 generated texts"):
        count_matches(["a", "b"], ["x"], reference)


def test_repeated_prompts_cannot_be_matched() -> None:
    with pytest.raises(ValueError, match="1 prompts repeat"):
        by_prompt(["a", "a", "b"], ["x", "y", "z"])


def test_hit_fractions_are_shares_of_the_prompt_tokens() -> None:
    tokens = {"local_compute": 500.0, "local_cache_hit": 300.0, "external_kv_transfer": 200.0}
    assert hit_fractions(tokens) == {"prefix_cache_hit_fraction": 0.3, "kvtier_hit_fraction": 0.2}
    assert hit_fractions({}) == {"prefix_cache_hit_fraction": 0.0, "kvtier_hit_fraction": 0.0}


def _run(throughput: float, texts: list[str], kvtier_tokens: float = 0.0) -> RunResult:
    figures = {"request_throughput": throughput, "ttft_mean_ms": 100.0 / throughput}
    figures |= {"ttft_median_ms": 90.0 / throughput, "ttft_p99_ms": 300.0 / throughput}
    tokens = {
        "local_compute": 100.0 - kvtier_tokens,
        "local_cache_hit": 0.0,
        "external_kv_transfer": kvtier_tokens,
    }
    return RunResult(figures, texts, tokens)


def test_summary_takes_medians_and_each_repetitions_own_ratios() -> None:
    prompts = ["p1", "p2", "p3"]
    same, one_off = ["a", "b", "c"], ["a", "B", "c"]
    runs = {
        "prefix_cache": [_run(1.0, same), _run(2.0, one_off), _run(1.5, same)],
        "kvtier": [_run(3.0, one_off, 40.0), _run(3.0, same, 60.0), _run(4.5, same, 50.0)],
        "ceiling": [_run(3.0, same), _run(4.0, one_off), _run(5.0, same)],
    }
    out = summarize(runs, prompts)
    assert out["prefix_cache"]["request_throughput"] == 1.5
    assert out["prefix_cache"]["request_throughput_runs"] == [1.0, 2.0, 1.5]
    assert out["prefix_cache"]["request_throughput_spread"] == [1.0, 2.0]
    assert out["kvtier"]["ttft_mean_ms"] == 33.3
    # Every run is compared with the first ceiling run, the ceiling's later runs included.
    assert out["kvtier"]["texts_equal_to_ceiling_runs"] == [2, 3, 3]
    assert out["ceiling"]["texts_equal_to_ceiling_runs"] == [3, 2, 3]
    assert out["ceiling"]["texts_equal_to_ceiling"] == 3.0
    assert out["kvtier"]["kvtier_hit_fraction"] == 0.5
    assert out["kvtier"]["requests"] == 3
    # Ratios within each repetition (3/1, 3/2, 4.5/1.5), then their median.
    assert out["throughput_ratio_vs_prefix_cache_runs"] == [3.0, 1.5, 3.0]
    assert out["throughput_ratio_vs_prefix_cache"] == 3.0
    assert out["throughput_ratio_vs_ceiling_runs"] == [1.0, 0.75, 0.9]
    assert out["throughput_ratio_vs_ceiling"] == 0.9
    assert "kvtier throughput / prefix_cache: 3.000 (1.500-3.000)" in serve.table(out)


def test_summary_needs_every_configuration_the_same_number_of_times() -> None:
    one = [_run(1.0, ["a"])]
    with pytest.raises(ValueError, match="every configuration needs a run"):
        summarize({"prefix_cache": one, "kvtier": one}, ["p"])
    with pytest.raises(ValueError, match="different numbers of times"):
        summarize({"prefix_cache": one, "kvtier": one, "ceiling": one * 2}, ["p"])


def test_a_vllm_result_without_its_figures_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lacks \['p99_ttft_ms', 'generated_texts'\]"):
        RunResult.from_vllm({"request_throughput": 1, "mean_ttft_ms": 1, "median_ttft_ms": 1}, {})


# ------------------------------------------------------------------------------ plumbing
METRICS = """# HELP vllm:prompt_tokens_by_source Prompt tokens by source.
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 700.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 256.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_cache_hit"} 44.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.7e+09
vllm:kvtier_active{engine="0",model_name="m"} 1.0
"""


def test_prometheus_samples_are_summed_by_label() -> None:
    assert serve.metric_by_label(METRICS, "vllm:prompt_tokens_by_source_total", "source") == {
        "local_compute": 700.0,
        "local_cache_hit": 300.0,
    }
    assert serve.metric_total(METRICS, "vllm:kvtier_active") == 1.0
    assert serve.metric_total(METRICS, "vllm:kvtier_missing") is None


def test_the_client_command_line_is_what_vllms_own_parser_reads() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    w = Workload(prefix_len=512, suffix_len=64, output_len=8, num_prefixes=10, prompts_per_prefix=3)
    argv = serve.client_argv(8123, "/m", w, Path("/r/out.json"), Path("/r/prompts.json"))
    assert argv[1:3] == ["-m", "kvtier.bench.serve_client"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    parser.add_argument("--prompts-out")
    args = parser.parse_args(argv[3:])
    assert (args.dataset_name, args.backend, args.base_url) == (
        "prefix_repetition",
        "vllm",
        "http://127.0.0.1:8123",
    )
    assert (args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len) == (512, 64)
    assert (args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len) == (10, 8)
    assert (args.num_prompts, args.max_concurrency, args.temperature) == (30, 4, 0.0)
    assert args.ignore_eos and args.save_result and args.save_detailed
    assert (args.result_dir, args.result_filename, args.prompts_out) == ("/r", "out.json", "/r/prompts.json")


def test_the_server_gets_exactly_the_sized_kv_memory() -> None:
    argv = serve.server_argv("/m", 9000, Workload(), 141, 32 * 16384)
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "141"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(141 * 32 * 16384)
    assert argv[argv.index("--max-model-len") + 1] == "1120"
    assert "--enable-prefix-caching" in argv


def test_save_keeps_the_other_sections(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"storage": {"x": 1}, "serve": {"old": True}}))
    serve.save({"new": 2}, path)
    assert json.loads(path.read_text()) == {"storage": {"x": 1}, "serve": {"new": 2}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    fresh = tmp_path / "fresh.json"
    serve.save({"new": 3}, fresh)
    assert json.loads(fresh.read_text()) == {"serve": {"new": 3}}
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        serve.save({}, path)


def test_runs_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--runs", "0"])
    assert exc.value.code == 2
    assert "--runs must be at least 1, got 0" in capsys.readouterr().err


def test_a_workload_whose_prefixes_all_fit_is_refused_at_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--concurrency", "16", "--prefixes", "8", "--no-save"])
    assert exc.value.code == 2
    assert "all 8 prefixes fit in the KV memory of 16 concurrent requests" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--prompts-per-prefix", "0", "--no-save"])
    assert "prompts_per_prefix must be at least 1, got 0" in capsys.readouterr().err


def test_a_lower_tier_sits_beneath_a_cpu_tier_of_half_the_prefixes_or_as_told_empty_at_each_run(
    tmp_path: Path,
) -> None:
    def tiers(plan: serve.Plan, index: int) -> dict[str, Any]:
        with serve.kvtier_tiers(plan, 1000, tmp_path, index) as extra:
            return extra

    assert tiers(serve.Plan(Workload(), serve.SHAPE, 3, False), 0) == {}  # the embedded default
    cpu = str(8 * 32 * 1000)  # half the 16 prefixes of 1,024 tokens, in 32-token blocks
    disk = tiers(serve.Plan(Workload(), serve.SHAPE, 3, False, "disk"), 1)
    assert disk == {"cpu_size": cpu, "disk_path": str(tmp_path / "disk-2")}
    assert (tmp_path / "disk-2").is_dir()
    plan = serve.Plan(Workload(), serve.SHAPE, 3, False, "object", 2, ObjectStore("http://127.0.0.1:9", "b"))
    assert tiers(plan, 1) == {
        "cpu_size": str(2 * 32 * 1000),
        "object_url": "s3://b/serve-2",
        "object_endpoint": "http://127.0.0.1:9",
    }
    with pytest.raises(ValueError, match="allowed are disk, redis, object"):
        tiers(serve.Plan(Workload(), serve.SHAPE, 3, False, "tape"), 0)


def test_kvtier_hit_tokens_by_tier_are_medians_over_the_runs() -> None:
    prompts = ["p"]
    runs = {name: [_run(1.0, ["a"]) for _ in range(3)] for name in RUNS}
    runs["kvtier"] = [
        RunResult(r.figures, r.texts, r.prompt_tokens, hits)
        for r, hits in zip(
            runs["kvtier"],
            [{"cpu": 10.0, "object": 90.0}, {"cpu": 30.0, "object": 70.0}, {"cpu": 20.0}],
            strict=True,
        )
    ]
    out = summarize(runs, prompts)
    assert out["kvtier"]["kvtier_hit_tokens_by_tier"] == {"cpu": 20.0, "object": 70.0}
    assert "kvtier_hit_tokens_by_tier" not in out["ceiling"]


def test_the_cli_lists_the_serve_benchmark() -> None:
    assert cli.BENCHES["serve"][0] == "kvtier.bench.serve"


def test_results_go_to_the_working_directory_never_beside_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make bench` and `kvtier bench serve` write one JSON, kvtier-bench.json, where they run."""
    bench_folder = Path(serve.__file__).parent
    before = set(bench_folder.iterdir())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_all, "run_all", lambda skip_ttft: {"measured_at": "now"})
    assert bench_all.main(["--no-chart"]) == 0
    assert serve._parser().parse_args([]).out == Path("kvtier-bench.json")
    serve.save({"figure": 1.0}, serve._parser().parse_args([]).out)
    assert json.loads((tmp_path / "kvtier-bench.json").read_text()) == {
        "measured_at": "now",
        "serve": {"figure": 1.0},
    }
    assert f"wrote {Path('kvtier-bench.json')}" in capsys.readouterr().out
    assert set(bench_folder.iterdir()) == before


# ------------------------------------------------------------------------------ end to end
def _warm_process(argv: list[str], log: BinaryIO, env: dict[str, str]) -> WarmProcess:
    assert argv[:2] == [sys.executable, "-m"], argv
    return start_server(argv[2], argv[3:], env, log.fileno())


def _check_section(section: dict[str, Any], requests: int) -> None:
    for key in ("throughput_ratio_vs_prefix_cache", "throughput_ratio_vs_ceiling"):
        assert isinstance(section[key], float) and section[key] > 0
        assert len(section[f"{key}_runs"]) == 1 and section[f"{key}_spread"] == [section[key]] * 2
    for name in RUNS:
        run = section[name]
        assert run["requests"] == requests
        for key in ("request_throughput", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms"):
            assert isinstance(run[key], float) and run[key] > 0, (name, key)
            assert run[f"{key}_runs"] == [run[key]] and run[f"{key}_spread"] == [run[key]] * 2
        assert run["ttft_median_ms"] <= run["ttft_p99_ms"]
        assert isinstance(run["texts_equal_to_ceiling_runs"][0], int)
        assert 0 <= run["texts_equal_to_ceiling"] <= requests
        assert 0 <= run["prefix_cache_hit_fraction"] + run["kvtier_hit_fraction"] < 1
    assert section["ceiling"]["texts_equal_to_ceiling"] == requests  # the reference itself
    # kvtier served prompt tokens in its run only: the quick workload reuses prefixes after the
    # constrained memory has evicted them.
    assert section["kvtier"]["kvtier_hit_fraction"] > 0
    assert section["prefix_cache"]["kvtier_hit_fraction"] == 0 == section["ceiling"]["kvtier_hit_fraction"]


@pytest.mark.e2e
def test_quick_run_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The servers and clients fork from the tests' warm starter instead of importing vLLM afresh
    # each: what this test checks is the benchmark's flow and figures, not a process's start-up.
    monkeypatch.setattr(serve, "start_process", _warm_process)
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"storage": {"kept": True}}))
    assert serve.main(["--quick", "--runs", "1", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    _check_section(printed, serve.QUICK.num_prompts)
    saved = json.loads(out.read_text())
    assert saved["storage"] == {"kept": True} and saved["serve"] == printed
    setup = printed["setup"]
    assert setup["quick"] is True and setup["runs"] == 1
    assert setup["kv_blocks"] == {"constrained": 23, "ceiling": 113}
    assert isinstance(printed["seconds"], float) and printed["measured_at"].endswith("Z")
