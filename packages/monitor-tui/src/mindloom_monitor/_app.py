"""The Textual app: a watcher thread tails the run directories and posts coalesced
batches; the widgets redraw from `RunData` on the UI thread, at most a few times a
second, and only when something changed."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Grid, Vertical, VerticalScroll
from textual.widgets import Footer, Log, RichLog, Static

from mindloom_monitor._panes import PaneDrawing
from mindloom_monitor._source import METRICS, RunSource, apply_batch
from mindloom_monitor._stats import RunData, Settings, fmt_count, fmt_duration
from mindloom_monitor._widgets import (
    HEALTH_PANE,
    LOG_KEEP,
    MOE_PANE,
    PANE_KEYS,
    PANE_LABELS,
    PANES,
    RANGES,
    ConfigScreen,
    HeaderBar,
    MetricPlot,
    RunBatch,
    Watcher,
    WatcherError,
)


class MonitorApp(PaneDrawing, App):
    TITLE = "mindloom-monitor"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #header { height: 2; background: $panel; padding: 0 1; }
    #tabs { height: 1; padding: 0 1; color: $text-muted; }
    #body { height: 1fr; }
    .pane { display: none; height: 1fr; }
    .pane.-active { display: block; }
    #plot-grid { layout: grid; grid-size: 2 2; grid-gutter: 0 1; height: 1fr; }
    #waiting { display: none; height: 1fr; content-align: center middle; color: $warning; }
    #plots.-waiting #waiting { display: block; }
    #plots.-waiting #plot-grid { display: none; }
    #events, #log { scrollbar-size-vertical: 1; }
    #moe { layout: horizontal; }
    #moe-heat { width: 1fr; height: 1fr; scrollbar-size-vertical: 1; }
    #moe-plots { width: 1fr; height: 1fr; }
    #moe-plots MetricPlot { height: 1fr; }
    #health { layout: horizontal; }
    #health-box { width: 1fr; height: 1fr; scrollbar-size-vertical: 1; }
    #health-plots { width: 1fr; height: 1fr; }
    #health-plots MetricPlot { height: 1fr; }
    #main.-wide #tabs { display: none; }
    #main.-wide #body { layout: grid; grid-size: 2 2; grid-rows: 2fr 1fr; }
    #main.-wide .pane { display: block; border: round $panel-lighten-2; }
    #main.-wide #plots { column-span: 2; border: none; }
    #main.-wide .pane:focus { border: round $accent; }
    #main.-wide #moe { display: none; }
    #main.-wide.-moe #body { grid-size: 2 3; grid-rows: 3fr 2fr 1fr; }
    #main.-wide.-moe #moe { display: block; column-span: 2; border: none; }
    #main.-wide #health { display: none; }
    #main.-wide.-health #body { grid-size: 2 3; grid-rows: 3fr 2fr 1fr; }
    #main.-wide.-health #health { display: block; column-span: 2; border: none; }
    #main.-wide.-moe.-health #body { grid-size: 2 4; grid-rows: 3fr 2fr 2fr 1fr; }
    """
    BINDINGS = [
        Binding("tab", "next_pane", "Pane", priority=True),
        Binding("1", "pane('plots')", "Plots", show=False),
        Binding("2", "pane('events')", "Events", show=False),
        Binding("3", "pane('log')", "Log", show=False),
        Binding("4", "pane('moe')", "MoE", show=False),
        Binding("5", "pane('health')", "Health", show=False),
        Binding("r", "cycle_range", "Range"),
        Binding("p", "toggle_follow", "Pause"),
        Binding("space", "toggle_follow", "Pause", show=False),
        Binding("o", "toggle_overlay", "Overlay"),
        Binding("n", "next_run", "Next run"),
        Binding("c", "show_config", "Config"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        run_dirs: list[str],
        *,
        settings: Settings | None = None,
        last_n: int | None = None,
        clock: Callable[[], float] = time.time,
        poll_interval: float = 0.1,
        max_interval: float = 0.5,
        tick: float = 1.0,
        tail_bytes: int = 2 << 20,
        samples: int = 2000,
    ) -> None:
        super().__init__()
        self.runs = [RunData(d, settings) for d in run_dirs]
        self.sources = [RunSource(d, tail_bytes=tail_bytes, samples=samples) for d in run_dirs]
        self.logs: list[deque[str]] = [deque(maxlen=LOG_KEEP) for _ in run_dirs]
        self.log_versions = [0] * len(run_dirs)
        self.clock = clock
        self.poll_interval = poll_interval
        self.max_interval = max_interval
        self.tick = tick
        self.selected = 0
        self.pane = "plots"
        self.following = True
        self.overlay = False
        self.range_index = RANGES.index(last_n) if last_n in RANGES else 0
        self.custom_range = last_n if last_n not in RANGES else None
        self.loaded = 0  # runs whose initial read has been applied
        self.batches = 0  # batches received (tests wait on this)
        self.redraws = 0
        self._drawn: tuple = ()
        self._log_key: tuple | None = None
        self._events_drawn = 0
        self._redraw_pending = False
        self._watcher: Watcher | None = None

    # --- layout ------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Vertical(id="main"):
            yield HeaderBar(id="header")
            yield Static(id="tabs")
            with Container(id="body"):
                with Container(id="plots", classes="pane -active"):
                    yield Static(id="waiting")
                    with Grid(id="plot-grid"):
                        for key in ("loss", "lr", "grad_norm", "throughput"):
                            yield MetricPlot(id=f"plot-{key}")
                with Container(id="moe", classes="pane"):
                    # not focusable: focus stays where it was in the layout without MoE
                    with VerticalScroll(id="moe-heat", can_focus=False):
                        yield Static(id="moe-heat-text")
                    with Vertical(id="moe-plots"):
                        yield MetricPlot(id="plot-moe_imbalance")
                        yield MetricPlot(id="plot-mtp_loss")
                with Container(id="health", classes="pane"):
                    with VerticalScroll(id="health-box", can_focus=False):
                        yield Static(id="health-text")
                    with Vertical(id="health-plots"):
                        yield MetricPlot(id="plot-comm_share")
                        yield MetricPlot(id="plot-data_wait")
                        yield MetricPlot(id="plot-mem")
                events = RichLog(id="events", classes="pane", max_lines=2000, wrap=False)
                events.border_title = "events"
                yield events
                log = Log(id="log", classes="pane", max_lines=LOG_KEEP)
                log.border_title = "train.log"
                yield log
            yield Footer()

    def on_mount(self) -> None:
        self._apply_size()
        self._update_tabs()
        self._update_header()
        self._watcher = Watcher(self, self.sources, self.poll_interval, self.max_interval)
        self._watcher.start()
        self.set_interval(self.tick, self._on_tick)

    def on_unmount(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    def on_resize(self) -> None:
        self._apply_size()

    def _apply_size(self) -> None:
        width, height = self.size
        self.query_one("#main").set_class(width >= 120 and height >= 36, "-wide")

    @property
    def wide(self) -> bool:
        return self.query_one("#main").has_class("-wide")

    # --- data --------------------------------------------------------------------------
    def on_run_batch(self, message: RunBatch) -> None:
        data = self.runs[message.index]
        try:
            apply_batch(data, message.batch)
        except Exception as exc:  # shown as an event: the monitor must outlive bad data
            data.note("error", f"could not apply new lines: {type(exc).__name__}: {exc}", "error")
        log = self.logs[message.index]
        if message.batch.log_reset:
            log.clear()
        if message.batch.log_reset or message.batch.log_lines:
            log.extend(message.batch.log_lines)
            self.log_versions[message.index] += 1
        if message.batch.initial:
            self.loaded += 1
        elif message.batch.records:
            data.seen(self.clock())
        self._sync_moe()
        self.batches += 1
        self._update_header()
        self._schedule_redraw()

    def on_watcher_error(self, message: WatcherError) -> None:
        self.runs[message.index].note("error", message.text, "error")
        self._schedule_redraw()

    def _on_tick(self) -> None:
        now = self.clock()
        if any([data.check_stall(now) for data in self.runs]):
            self._schedule_redraw()
        self._update_header()

    # --- drawing -----------------------------------------------------------------------
    @property
    def last_n(self) -> int | None:
        return self.custom_range if self.custom_range is not None else RANGES[self.range_index]

    @property
    def range_label(self) -> str:
        n = self.last_n
        return "all" if n is None else f"last {n}"

    def _header_text(self) -> Text:
        data = self.runs[self.selected]
        now = self.clock()
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(data.name, style="bold")
        status = data.status()
        style = {"running": "green", "completed": "green", "waiting": "yellow"}.get(
            status, "bold red"
        )
        t.append(f" {status}", style=style)
        if data.last is not None:
            step, total = data.last.step, data.total_steps
            of = f"{step:,}/{total:,} ({100 * step / total:.0f}%)" if total else f"{step:,}"
            t.append(f"  step {of}")
            t.append(f"  elapsed {fmt_duration(data.elapsed(now))}  ETA {fmt_duration(data.eta())}")
        elif status == "waiting":
            t.append(
                f"  waiting for {METRICS}" if not data.metrics_exists else "  no metric lines yet"
            )
        t.append("\n")
        if data.alerts:  # first on its line: a narrow terminal cuts the end of the line
            last = data.alerts[-1]
            t.append(f"health: {len(data.alerts)} alert(s), last {last.kind}", style="bold yellow")
            t.append("  ")
        ckpt = data.last_checkpoint
        t.append(f"tokens {fmt_count(data.tokens)}  ckpt {ckpt[0] if ckpt else '-'}  ")
        t.append(
            f"skipped {data.skipped_lines} lines", style="bold red" if data.skipped_lines else ""
        )
        t.append(f"  range {self.range_label}  ")
        t.append(
            "following" if self.following else "PAUSED", style="" if self.following else "reverse"
        )
        if len(self.runs) > 1:
            t.append(f"  run {self.selected + 1}/{len(self.runs)}")
        if self.overlay:
            t.append("  overlay")
        return t

    def _update_header(self) -> None:
        for header in self.query("#header").results(HeaderBar):  # absent while shutting down
            header.show(self._header_text())

    @property
    def panes(self) -> tuple[str, ...]:
        data = self.runs[self.selected]
        return (
            PANES
            + ((MOE_PANE,) if data.has_moe else ())
            + ((HEALTH_PANE,) if data.has_health else ())
        )

    def _sync_moe(self) -> None:
        """Offer the MoE and Health panes while the selected run has their fields (and
        only then)."""
        data = self.runs[self.selected]
        main = self.query("#main")
        if not main:
            return
        changed = False
        for pane, has in ((MOE_PANE, data.has_moe), (HEALTH_PANE, data.has_health)):
            if main.first().has_class(f"-{pane}") == has:
                continue
            changed = True
            main.first().set_class(has, f"-{pane}")
            if not has and self.pane == pane:
                self.pane = "plots"
        if changed:
            self._update_tabs()

    def _update_tabs(self) -> None:
        parts = []
        for pane in self.panes:
            label = f"{PANE_KEYS[pane]} {PANE_LABELS[pane]}"
            if pane == self.pane:
                parts.append(f"[reverse][@click=app.pane('{pane}')] {label} [/][/]")
            else:
                parts.append(f"[@click=app.pane('{pane}')] {label} [/]")
        self.query_one("#tabs", Static).update("".join(parts))
        for pane in (*PANES, MOE_PANE, HEALTH_PANE):
            self.query_one(f"#{pane}").set_class(pane == self.pane, "-active")

    def _schedule_redraw(self) -> None:
        if not self._redraw_pending:
            self._redraw_pending = True
            self.set_timer(0.15, self._redraw)

    def _redraw(self) -> None:
        self._redraw_pending = False
        if not self.following or not self.query("#plots"):  # paused, or shutting down
            return
        data = self.runs[self.selected]
        waiting = data.last is None
        plots = self.query_one("#plots")
        plots.set_class(waiting, "-waiting")
        if waiting:
            where = os.path.join(data.run_dir, METRICS)
            what = "waiting for" if not data.metrics_exists else "no metrics yet in"
            skipped = f"\n(skipped {data.skipped_lines} bad lines)" if data.skipped_lines else ""
            self.query_one("#waiting", Static).update(f"{what} {where}{skipped}")
        key = (self.selected, self.overlay, self.last_n, self.size, *(r.version for r in self.runs))
        if key != self._drawn:
            self._drawn = key
            try:
                self._draw_plots()
            except Exception as exc:  # e.g. plotext on values it cannot scale
                data.note(
                    "error", f"could not draw the plots: {type(exc).__name__}: {exc}", "error"
                )
            self._draw_events()
            self.redraws += 1
        log_key = (self.selected, self.log_versions[self.selected])
        if log_key != self._log_key:
            self._log_key = log_key
            self._draw_log()
        self._update_header()

    @property
    def settled(self) -> bool:
        """Every run read and everything received drawn (tests wait on this)."""
        key = (self.selected, self.overlay, self.last_n, self.size, *(r.version for r in self.runs))
        return self.loaded == len(self.runs) and not self._redraw_pending and key == self._drawn

    def _full_redraw(self) -> None:
        self._drawn = ()
        self._events_drawn = len(self.runs[self.selected].events) + 1  # forces a clear
        self._log_key = None
        self._schedule_redraw()

    # --- actions -----------------------------------------------------------------------
    def action_pane(self, pane: str) -> None:
        if pane not in self.panes:
            return
        self.pane = pane
        self._update_tabs()
        if pane != "plots":
            self.query_one(f"#{pane}").focus()

    def action_next_pane(self) -> None:
        panes = self.panes
        self.action_pane(panes[(panes.index(self.pane) + 1) % len(panes)])

    def action_cycle_range(self) -> None:
        if self.custom_range is not None:
            self.custom_range = None
            self.range_index = 0
        else:
            self.range_index = (self.range_index + 1) % len(RANGES)
        self._update_header()
        self._schedule_redraw()

    def action_toggle_follow(self) -> None:
        self.following = not self.following
        self._update_header()
        if self.following:
            self._full_redraw()

    def action_toggle_overlay(self) -> None:
        self.overlay = not self.overlay
        self._update_header()
        self._schedule_redraw()

    def action_next_run(self) -> None:
        self.selected = (self.selected + 1) % len(self.runs)
        self._sync_moe()
        self._update_header()
        self._full_redraw()

    def action_show_config(self) -> None:
        self.push_screen(ConfigScreen(self.runs[self.selected].run_dir))

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action in ("next_run", "toggle_overlay") and len(self.runs) < 2:
            return False  # hidden from the footer: one run has nothing to switch or overlay
        return True
