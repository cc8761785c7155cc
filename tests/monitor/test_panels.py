"""The plots a person wants, chosen from the keys the trainer writes, with honest axes and labels."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from run_rows import ppo_rows

from hybridflow.monitor.panels import Panel, choose_panels, choose_timeline
from hybridflow.monitor.plots import panel_figure, timeline_figure


def panels_by_name(rows: list[dict[str, float]]) -> dict[str, Panel]:
    return {panel.filename: panel for panel in choose_panels(rows)}


def labels(panel: Panel) -> list[str]:
    return [line.label for line in panel.series]


def test_every_training_signal_gets_a_panel() -> None:
    panels = panels_by_name(ppo_rows())
    assert list(panels)[:8] == ["reward.png", "kl.png", "entropy.png", "clip_fraction.png", "grad_norm.png",
                                "loss.png", "response_length.png", "node_time.png"]
    assert set(labels(panels["kl.png"])) == {"kl", "actor/kl_loss", "actor/approx_kl"}
    assert set(labels(panels["clip_fraction.png"])) == {"actor/clipfrac", "actor/clipfrac_lower",
                                                        "critic/vf_clipfrac"}
    assert set(labels(panels["grad_norm.png"])) == {"actor/grad_norm", "critic/grad_norm"}
    assert set(labels(panels["loss.png"])) == {"actor/loss", "actor/pg_loss", "critic/loss", "critic/vf_loss"}
    assert set(labels(panels["response_length.png"])) == {"response_length/mean", "response_length/max"}
    assert {"memory.png", "throughput.png", "learning_rate.png"} <= set(panels)


def test_reward_has_its_spread_and_no_one_step_moving_average() -> None:
    rows = ppo_rows(steps=8)
    reward = panels_by_name(rows)["reward.png"]
    assert reward.band is not None and reward.band.values[0] == pytest.approx(0.3)
    figure = panel_figure(reward)
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    plt.close(figure)
    assert legend == ["mean reward", "± std over samples"]  # 8 steps: no rolling mean at all
    figure = panel_figure(panels_by_name(ppo_rows(steps=40))["reward.png"])
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    plt.close(figure)
    assert "rolling mean over 4 steps" in legend


def test_node_time_has_units_and_throughput_a_log_axis() -> None:
    panels = panels_by_name(ppo_rows())
    times = panels["node_time.png"]
    assert times.ylabel == "milliseconds per step"  # every node under a second
    assert dict(zip(labels(times), [line.values[0] for line in times.series], strict=True))["actor_generate"] == 400
    slow = [{**row, "time/step": 12.0} for row in ppo_rows()]
    assert panels_by_name(slow)["node_time.png"].ylabel == "seconds per step"
    assert set(labels(panels["throughput.png"])) == {"whole step", "actor_generate", "reward"}
    figure = panel_figure(panels["throughput.png"])
    assert figure.axes[0].get_yscale() == "log"
    plt.close(figure)


def test_memory_axis_starts_at_zero_so_noise_stays_small() -> None:
    figure = panel_figure(panels_by_name(ppo_rows())["memory.png"])
    low, high = figure.axes[0].get_ylim()
    plt.close(figure)
    assert low == 0 and 2.0 < high < 3.0


def test_missing_and_non_finite_values_are_skipped() -> None:
    rows = [{"step": 0, "reward/mean": 0.1, "kl": float("nan")}, {"step": 1, "reward/mean": 0.2},
            {"step": 2, "reward/mean": float("inf")}]
    panels = panels_by_name(rows)
    assert list(panels) == ["reward.png"] and panels["reward.png"].series[0].steps == (0.0, 1.0)
    assert panels["reward.png"].band is None


def test_agent_metrics_get_their_panels() -> None:
    rows = [{"step": step, "agent/turns_mean": 1.5 + step, "agent/turns_max": 3.0, "agent/tool_call_rate": 0.5,
             "agent/truncated_fraction": 0.1, "agent/tool_errors": 1.0, "agent/tool_timeouts": 0.0,
             "agent/tool_latency_p50_s": 0.1, "agent/tool_latency_p95_s": 0.9} for step in range(3)]
    panels = panels_by_name(rows)
    assert set(labels(panels["agent_turns.png"])) == {"turns_mean", "turns_max"}
    assert panels["agent_tool_rates.png"].scale == "fraction"
    assert set(labels(panels["agent_tool_latency.png"])) == {"p50", "p95"}
    assert set(labels(panels["agent_tool_failures.png"])) == {"tool_errors", "tool_timeouts"}


def test_the_timeline_is_the_median_steps_with_each_nodes_busy_seconds() -> None:
    """Steps 1-3 recorded spans (step 0 is the warm-up, left out): the median step by time/step is step 3. A
    streamed scorer's span holds the wait between its two calls; its label says the seconds its calls ran."""
    def step(number: int, seconds: float) -> dict[str, float]:
        return {"step": number, "time/step": seconds, "time/actor_generate": 0.4, "time/reward_score": 0.1,
                "timeline/actor_generate/start_s": 0.0, "timeline/actor_generate/end_s": 0.4,
                "timeline/reward_score/start_s": 0.2, "timeline/reward_score/end_s": 0.5 + number / 100,
                "timeline/actor_update/start_s": 0.55, "timeline/actor_update/end_s": seconds}

    rows = [step(0, 9.0), step(1, 1.0), step(2, 0.8), step(3, 0.9)]
    timeline = choose_timeline(rows)
    assert timeline is not None and timeline.step == 3 and timeline.step_seconds == 0.9
    assert [bar.node for bar in timeline.bars] == ["actor_generate", "reward_score", "actor_update"]
    score = timeline.bars[1]
    assert (score.start, score.end, score.busy) == (0.2, 0.53, 0.1)
    assert timeline.bars[2].busy != timeline.bars[2].busy  # no time/actor_update in these rows: NaN, no label
    figure = timeline_figure(timeline)
    axis = figure.axes[0]
    assert [tick.get_text() for tick in axis.get_yticklabels()] == ["actor_generate", "reward_score", "actor_update"]
    assert [text.get_text() for text in axis.texts] == ["0.4 s", "0.1 s", ""]
    plt.close(figure)
    assert choose_timeline(ppo_rows()) is None  # a run from before spans were recorded
    assert figure.axes[0].get_legend() is None  # no plan: nothing to tell apart


def test_the_timeline_puts_the_plans_span_under_each_measured_one() -> None:
    rows = [{"step": 0, "time/step": 1.0, "time/actor_generate": 0.5, "timeline/actor_generate/start_s": 0.0,
             "timeline/actor_generate/end_s": 0.5, "timeline/actor_update/start_s": 0.6,
             "timeline/actor_update/end_s": 1.0}]
    timeline = choose_timeline(rows, {"actor_generate": (0.0, 0.4), "reference_ref_logprob": (0.4, 0.5)})
    assert timeline is not None
    assert [(bar.node, bar.planned) for bar in timeline.bars] == [("actor_generate", (0.0, 0.4)),
                                                                   ("actor_update", None)]
    figure = timeline_figure(timeline)
    axis = figure.axes[0]
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["measured", "planned"]
    planned = [patch for patch in axis.patches if patch.get_hatch() == "//"]
    assert [(patch.get_x(), patch.get_width()) for patch in planned] == [(0.0, pytest.approx(0.4))]
    plt.close(figure)
