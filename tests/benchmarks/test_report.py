"""The report of a run: table, headline ratios (whole-server cost first), README section."""

import json
import math

import pytest

from benchmarks.run_report import (cpu_split_table, headline_table, markdown_table, ratio_cell, ratios, readme_section,
                                   render_readme, targets_table)


def _row(mode, rtt, ses, srv, busy=float("nan"), itl=50.0):
    return {"mode": mode, "rtt_ms": rtt, "sessions": ses, "tokens_per_server_cpu_s": srv,
            "server_tokens_per_busy_s": busy, "server_tokens_per_cpu_s": srv * 1.2, "server_tokens_per_s": srv / 2,
            "server_cpu_share": 0.5, "itl_ms_mean": itl, "itl_ms_p50": itl, "itl_ms_p99": 2 * itl,
            "tokens_per_verify": 1.0, "uplink_bytes_per_token": 12.0, "downlink_bytes_per_token": float("nan"),
            "cost_eff_ktok_per_usd": srv}


ROWS = [_row("server_ar", 15, 1, 30.0, 32.0), _row("edge_full", 15, 1, 45.0, 46.0, itl=40.0),
        _row("vllm_ar", 15, 1, 50.0), _row("vllm_ngram", 15, 1, 60.0),
        _row("server_ar", 15, 4, 40.0, 48.0), _row("edge_full", 15, 4, 40.0, 42.0)]
COND = {"run": "r1", "wall_minutes": 9.0, "target": "embedded (SmolLM2-135M-Instruct, bf16)", "draft_note": "d",
        "server_side_drafter": "s", "fixed_depth": 2, "tree_budget": 32, "topk": 4, "max_tokens": 64,
        "sampling": "greedy, ignore_eos", "prompts_per_config": "8", "rtt_sweep_ms": [15], "rtt_sweep_sessions": 4,
        "sessions_sweep": [1, 4], "sessions_sweep_rtt_ms": 15, "bandwidth_mbps": "unlimited", "cores": "c",
        "peers": {"vllm_ar": "measured", "vllm_ngram": "measured"}}


def test_ratios_against_every_baseline_present():
    r = ratios(ROWS, 15, 1)
    assert set(r) == {"edge_full_vs_server_ar", "edge_full_vs_vllm_ar", "edge_full_vs_vllm_ngram"}
    assert r["edge_full_vs_vllm_ar"]["tokens_per_server_cpu_s"] == pytest.approx(0.9)
    assert math.isnan(r["edge_full_vs_vllm_ar"]["server_tokens_per_busy_s"])  # vLLM has no busy clock
    assert r["edge_full_vs_server_ar"]["itl_ms_mean_change"] == pytest.approx(-0.2)


def test_headline_uses_whole_server_cost_with_conditions_in_every_row():
    lines = headline_table({"conditions": COND, "rows": ROWS})
    body = [ln for ln in lines if ln.startswith("| 15 |")]
    assert len(body) == 2
    assert "`edge_full` / `vllm_ar`" in lines[4]
    assert body[0].split(" | ")[2:6] == ["30.0", "45.0", "50.0", "60.0"]
    assert "x0.90" in body[0] and "x1.50" in body[0]  # edge_full / vllm_ar, edge_full / server_ar
    for b in body:
        assert "SmolLM2-135M-Instruct, bf16" in b and "core 0" in b and "RTT 15 ms" in b and "session(s)" in b
    assert "| 15 | 4 | 40.0 | 40.0 | - | - |" in body[1]
    assert "| 40.0 / 50.0 |" in body[0]  # ITL p50: edge_full / vllm_ar


def test_a_ratio_of_repeated_rows_gives_its_range_over_the_repeats():
    ef = dict(_row("edge_full", 15, 2, 150.0), repeat_tokens_per_server_cpu_s=[140.0, 160.0])
    ar = dict(_row("server_ar", 15, 2, 150.0), repeat_tokens_per_server_cpu_s=[150.0, 150.0])
    assert ratio_cell(ef, ar) == "x1.00 (0.93-1.07)"
    assert ratio_cell(ef, _row("server_ar", 15, 2, 100.0)) == "x1.50"  # measured once: no range
    assert ratio_cell(ef, {}) == "-"
    body = [ln for ln in headline_table({"conditions": COND, "rows": [ef, ar]}) if ln.startswith("| 15 |")]
    assert "| x1.00 (0.93-1.07) |" in body[0]


def test_headline_says_when_peers_were_skipped_and_when_a_run_predates_it():
    cond = dict(COND, peers={"vllm_ar": "skipped: .venv-vllm is absent (run `make bench-peers`)"})
    lines = headline_table({"conditions": cond, "rows": [r for r in ROWS if not r["mode"].startswith("vllm")]})
    assert any("skipped" in ln and "make bench-peers" in ln for ln in lines)
    old = [{k: v for k, v in r.items() if k != "tokens_per_server_cpu_s"} for r in ROWS]
    assert "predates" in headline_table({"conditions": COND, "rows": old})[0]


def test_table_prints_nan_as_dash_and_readme_section_renders(tmp_path):
    t = markdown_table(ROWS)
    assert "tok/srv-cpu-s" in t.splitlines()[0] and "| - |" in t
    sec = readme_section({"conditions": COND, "rows": ROWS})
    assert sec.startswith("## Latest full run") and "### Headline" in sec and "### All figures" in sec
    assert "edge_full_vs_vllm_ar: tokens/whole-server-cpu-s x0.90" in sec
    readme = tmp_path / "README.md"
    readme.write_text("# R\n\nintro\n\n## Latest full run\n\nold\n\n### All figures\n\nold too\n\n"
                      "## Another issue's figures\n\nkept first\n\n## Discussion\n\nkept\n")
    doc = tmp_path / "run.json"
    doc.write_text(json.dumps({"conditions": COND, "rows": ROWS}))
    render_readme(doc, readme)
    text = readme.read_text()
    assert text.startswith("# R\n\nintro") and "old" not in text
    assert text.endswith("## Another issue's figures\n\nkept first\n\n## Discussion\n\nkept\n")


def test_table_has_verify_and_temperature_columns_when_rows_differ_by_them():
    greedy = markdown_table(ROWS)  # no rule/temperature keys: the columns stay out
    assert "| verify |" not in greedy and "| T |" not in greedy
    same = [dict(r, verify="match" if r["mode"] != "server_ar" else "-", temperature=0.0) for r in ROWS]
    assert markdown_table(same).splitlines()[0] == greedy.splitlines()[0]  # defaults everywhere: as before
    rules = [dict(ROWS[1], verify=v, temperature=t) for v in ("match", "rejection", "tree-rejection")
             for t in (0.7, 1.0)] + [dict(ROWS[0], verify="-", temperature=0.7)]
    lines = markdown_table(rules).splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    assert head[:3] == ["mode", "verify", "T"]
    cells = [[c.strip() for c in ln.strip("|").split("|")][:3] for ln in lines[2:]]
    assert cells[0] == ["edge_full", "match", "0.7"] and cells[3] == ["edge_full", "rejection", "1.0"]
    assert cells[-1] == ["server_ar", "-", "0.7"]
    assert len({tuple(c) for c in cells}) == len(cells)  # every row tells its rule and temperature
    one = markdown_table([dict(ROWS[1], verify="tree-rejection", temperature=1.0)]).splitlines()[0]
    assert "| verify | T |" in one  # a single non-default rule is still named


def test_cpu_split_table_sets_the_forwards_alone_against_vllm():
    split = {"cpu_ms_per_token_forward": 10.0, "cpu_ms_per_token_verifier_other": 2.0, "cpu_ms_per_token_router": 2.0,
             "cpu_ms_per_token_proxy": 0.5, "cpu_ms_per_token_background": 1.5, "tokens_per_forward_cpu_s": 100.0}
    rows = [dict(r, **split) if r["mode"] in ("server_ar", "edge_full") else r for r in ROWS]
    lines = cpu_split_table({"conditions": COND, "rows": rows})
    body = [ln for ln in lines if ln.startswith("| 15 |")]
    assert len(body) == 4 and "`edge_full`" in body[1]
    # 16 ms per token for the whole server; vllm_ar's 50 tok/s = 20 ms; forwards alone: 100 / 50
    assert "| 10.00 | 2.00 | 2.00 | 0.50 | 1.50 | 16.00 | 20.00 | 100.0 | x2.00 |" in body[1]
    assert body[3].endswith("| - | 100.0 | - |")  # no vLLM row at 4 sessions
    assert "### Where the server's CPU goes" in readme_section({"conditions": COND, "rows": rows})
    assert cpu_split_table({"conditions": COND, "rows": ROWS}) == []  # runs before the forward clock: no table


def test_issue_15_targets_each_get_a_figure_and_a_verdict():
    def node_row(ses, srv, nodes, itl=50.0):
        return dict(_row("edge_full", 15, ses, srv, itl=itl), verified_nodes_per_round=nodes)

    rows = [node_row(1, 150.0, 2.8, itl=40.0), _row("vllm_ar", 15, 1, 100.0, itl=38.0),
            _row("server_sd", 15, 1, 80.0), _row("server_ar", 15, 1, 100.0),
            node_row(4, 119.0, 0.0), _row("vllm_ar", 15, 4, 100.0), _row("server_ar", 15, 4, 119.5),
            node_row(16, 300.0, 0.04), _row("server_sd", 15, 16, 100.0),  # no vllm_ar at 16
            _row("server_ar", 15, 50, 999.0)]  # another RTT: not a target's point
    lines = targets_table({"rows": rows})
    verdict = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.split("|")[-2].strip() for ln in lines[4:] if ln}
    assert verdict[("`edge_full` / `vllm_ar` >= x1.5", "1")] == "met"  # x1.50 exactly
    assert verdict[("`edge_full` / `vllm_ar` >= x1.2", "4")] == "**missed**"  # x1.19
    assert verdict[("`edge_full` / `vllm_ar` >= x1.0", "16")] == "not measured"
    assert verdict[("`edge_full` / `server_sd` >= x2.0", "1")] == "**missed**"  # x1.88
    assert verdict[("`edge_full` / `server_sd` >= x2.0", "4")] == "not measured"
    assert verdict[("`edge_full` / `server_sd` >= x2.0", "16")] == "met"
    # x0.996 prints as x1.00, and is still a miss: never rounded up
    assert "| x1.00 | **missed** |" in next(ln for ln in lines if "`server_ar` >= x1.0 | 4 |" in ln)
    assert verdict[("ITL p50 `edge_full` / `vllm_ar` <= x1.1", "1")] == "met"  # 40 / 38 = x1.05
    nodes = next(ln for ln in lines if ln.startswith("| verified nodes"))
    assert "| 1, 4, 16 | 2.80, 0.00, 0.04 | met |" in nodes  # 0.00 -> 0.04 is within the stated slack
    rising = [node_row(1, 1.0, 0.0), node_row(4, 1.0, 1.0)]
    assert next(ln for ln in targets_table({"rows": rising}) if ln.startswith("| verified")).endswith("**missed** |")
