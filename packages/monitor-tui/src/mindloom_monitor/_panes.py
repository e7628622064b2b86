"""Drawing the panes of `MonitorApp` (plots, health, MoE, events, log), a mixin split
from `_app` (issue 21: modules of ~400 lines at most)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Log, RichLog, Static

from mindloom_monitor._health import health_lines
from mindloom_monitor._widgets import EVENT_STYLE, PALETTE, MetricPlot, heat_text


class PaneDrawing:
    """`MonitorApp`'s pane drawing; reads the app's runs, widgets and settings."""

    def _draw_plots(self) -> None:
        n = self.last_n
        buckets = max(50, self.size.width)
        runs = (
            list(enumerate(self.runs))
            if self.overlay
            else [(self.selected, self.runs[self.selected])]
        )
        loss, lr, grad, thr = [], [], [], []
        for i, data in runs:
            # One run: no legend (the titles say what is what), so the plots keep their
            # room at 80x24. Overlay: the run names label the main series.
            color = PALETTE[i % len(PALETTE)] if self.overlay else "cyan"
            name = data.name if self.overlay else ""
            if not self.overlay:
                loss.append(("", *data.view("loss", n, buckets), "left", "gray", "line"))
            loss.append((name, *data.view("smoothed", n, buckets), "left", color, "line"))
            ppl_color = color if self.overlay else "red"
            loss.append(("", *data.view("ppl", n), "right", ppl_color, "scatter"))
            lr.append((name, *data.view("lr", n, buckets), "left", color, "line"))
            grad.append((name, *data.view("grad_norm", n, buckets), "left", color, "line"))
            thr.append((name, *data.view("tokens_per_s", n, buckets), "left", color, "line"))
            xs, ys = data.view("mfu", n, buckets)
            mfu_color = color if self.overlay else "green"
            thr.append(("", xs, [100 * y for y in ys], "right", mfu_color, "line"))
        wide = self.size.width >= 120
        if self.overlay:
            loss_title = "smoothed loss · eval ppl (dots, right)" if wide else "smoothed · ppl (r)"
        else:
            loss_title = (
                "loss (grey), smoothed · eval ppl (dots, right)"
                if wide
                else "loss, smoothed · ppl (r)"
            )
        thr_title = "tokens/s · MFU % (right)" if wide else "tokens/s · MFU % (r)"
        self.query_one("#plot-loss", MetricPlot).draw(loss_title, loss)
        self.query_one("#plot-lr", MetricPlot).draw("learning rate", lr)
        self.query_one("#plot-grad_norm", MetricPlot).draw("grad norm", grad)
        self.query_one("#plot-throughput", MetricPlot).draw(thr_title, thr)
        if any(data.has_moe for _, data in runs):
            self._draw_moe(runs, n, buckets)
        if any(data.has_health for _, data in runs):
            self._draw_health(runs, n, buckets)

    def _draw_health(self, runs, n, buckets) -> None:
        comm, wait, mem = [], [], []
        for i, data in runs:
            color = PALETTE[i % len(PALETTE)] if self.overlay else "cyan"
            name = data.name if self.overlay else ""
            for out, key in ((comm, "comm_share"), (wait, "data_wait_frac")):
                xs, ys = data.view(key, n, buckets)
                out.append((name, xs, [100 * y for y in ys], "left", color, "line"))
            mem.append((name, *data.view("mem_rss_mb", n, buckets), "left", color, "line"))
        self.query_one("#plot-comm_share", MetricPlot).draw("communication % of step", comm)
        self.query_one("#plot-data_wait", MetricPlot).draw("data wait % of step", wait)
        self.query_one("#plot-mem", MetricPlot).draw("RSS MiB (rank 0)", mem)
        width = max(10, self.size.width // 2 - 12)
        text = "\n".join(health_lines(self.runs[self.selected], width=width))
        self.query_one("#health-text", Static).update(Text(text))

    def _draw_moe(self, runs, n, buckets) -> None:
        imb, mtp = [], []
        for i, data in runs:
            color = PALETTE[i % len(PALETTE)] if self.overlay else "cyan"
            name = data.name if self.overlay else ""
            imb.append(
                (name, *data.view("moe_imbalance_overall", n, buckets), "left", color, "line")
            )
            mtp.append((name, *data.view("mtp_loss", n, buckets), "left", color, "line"))
        self.query_one("#plot-moe_imbalance", MetricPlot).draw("expert load max/mean, overall", imb)
        self.query_one("#plot-mtp_loss", MetricPlot).draw("MTP loss", mtp)
        # the heat map takes half the width in both layouts; from the app's size, since a
        # hidden pane has none
        width = self.size.width // 2 - 2
        self.query_one("#moe-heat-text", Static).update(heat_text(self.runs[self.selected], width))

    def _format_event(self, ev) -> Text:
        where = f"{ev.step:>7}" if ev.step is not None else "      -"
        t = Text(no_wrap=True)
        t.append(where, style="dim")
        t.append(f" {ev.kind:<15}", style=EVENT_STYLE.get(ev.level, "") or "bold")
        t.append(ev.text, style=EVENT_STYLE.get(ev.level, ""))
        return t

    def _draw_events(self, full: bool = False) -> None:
        widget = self.query_one("#events", RichLog)
        events = self.runs[self.selected].events
        if full or self._events_drawn > len(events):
            widget.clear()
            self._events_drawn = 0
        for ev in events[self._events_drawn :]:
            widget.write(self._format_event(ev))
        self._events_drawn = len(events)

    def _draw_log(self) -> None:
        widget = self.query_one("#log", Log)
        lines = self.logs[self.selected]
        # The deque drops old lines, so a position is not stable: redraw the whole tail
        # when it changed (at most a few times a second, a few thousand short lines).
        widget.clear()
        widget.write_lines(list(lines))
