"""The Textual app: a watcher thread tails the run directories and posts coalesced
batches; the widgets redraw from `RunData` on the UI thread, at most a few times a
second, and only when something changed."""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from rich.syntax import Syntax
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Grid, Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Footer, Log, RichLog, Static
from textual_plotext import PlotextPlot

from mindloom_monitor._health import health_lines
from mindloom_monitor._moe import SHADES, heat_cells
from mindloom_monitor._source import CONFIG, METRICS, Batch, RunSource, apply_batch
from mindloom_monitor._stats import RunData, Settings, fmt_count, fmt_duration, fmt_num

RANGES: tuple[int | None, ...] = (None, 1000, 100)  # "all", then the last N steps
PANES = ("plots", "events", "log")
MOE_PANE = "moe"  # a fourth pane, offered only while the selected run has MoE fields
HEALTH_PANE = "health"  # offered while the selected run has health fields or alerts
PANE_LABELS = {"plots": "Plots", "events": "Events", "log": "Log", MOE_PANE: "MoE",
               HEALTH_PANE: "Health"}  # fmt: skip
PANE_KEYS = {"plots": 1, "events": 2, "log": 3, MOE_PANE: 4, HEALTH_PANE: 5}
LOG_KEEP = 2000  # lines of train.log kept per run
EVENT_STYLE = {"info": "", "warn": "yellow", "error": "bold red"}
PALETTE = ("cyan", "orange", "green", "magenta", "blue", "red")
CONFIG_MAX = 1 << 20
PLOT_LIMIT = 1e100  # larger magnitudes are left out of the plots (they stay in the events)


class RunBatch(Message):
    """New data for one run, coalesced by the watcher."""

    def __init__(self, index: int, batch: Batch) -> None:
        super().__init__()
        self.index = index
        self.batch = batch


class WatcherError(Message):
    def __init__(self, index: int, text: str) -> None:
        super().__init__()
        self.index = index
        self.text = text


class Watcher:
    """Polls every source with `stat` from one thread: fast while lines arrive, backing
    off to `max_interval` when idle, so an idle monitor costs a few syscalls a second."""

    def __init__(
        self, app: App, sources: list[RunSource], interval: float, max_interval: float
    ) -> None:
        self.app = app
        self.sources = sources
        self.interval = interval
        self.max_interval = max_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mindloom-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for src in self.sources:
            src.close()

    def _call(self, index: int, fn) -> bool:
        try:
            batch = fn()
        except Exception as exc:  # a bad file must never take the app down
            self.app.post_message(WatcherError(index, f"{type(exc).__name__}: {exc}"))
            return False
        if batch:
            self.app.post_message(RunBatch(index, batch))
            return True
        return False

    def _run(self) -> None:
        for i, src in enumerate(self.sources):
            if self._stop.is_set():
                return
            if not self._call(i, src.initial):
                self.app.post_message(RunBatch(i, Batch(initial=True)))
        delay = self.interval
        while not self._stop.wait(delay):
            busy = False
            for i, src in enumerate(self.sources):
                busy |= self._call(i, src.poll)
            delay = self.interval if busy else min(delay * 1.5, self.max_interval)


class MetricPlot(PlotextPlot):
    """A plotext plot that is rebuilt only when its data changes."""

    x_range: tuple[int, int] | None = None  # steps shown, for tests and the curious

    def draw(self, title: str, lines: list[tuple[str, list, list, str, str, str]]) -> None:
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(title)
        self.x_range = None
        for label, xs, ys, side, color, kind in lines:
            if any(abs(y) > PLOT_LIMIT for y in ys):  # plotext overflows on such ranges
                pts = [(x, y) for x, y in zip(xs, ys) if abs(y) <= PLOT_LIMIT]
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if not xs:
                continue
            lo, hi = (xs[0], xs[-1]) if self.x_range is None else self.x_range
            self.x_range = (min(lo, xs[0]), max(hi, xs[-1]))
            label = label or None  # plotext draws a legend entry for any label given
            if kind == "scatter":
                plt.scatter(xs, ys, label=label, yside=side, color=color, marker="dot")
            else:
                plt.plot(xs, ys, label=label, yside=side, color=color, marker="braille")
        self.refresh()

    def render(self):
        try:
            return super().render()
        except Exception as exc:  # never let one odd series take the app down
            return Text(f"cannot draw this plot: {type(exc).__name__}: {exc}", style="red")


def heat_text(data: RunData, width: int) -> Text:
    """The expert-load heat map of a run's newest `moe_load`: one row per MoE layer,
    one character per expert (or per group of neighbours when they do not fit), shaded
    by the expert's share against an even share (SHADES), the row's max/mean at the
    end, and the legend."""
    t = Text(no_wrap=True, overflow="crop")
    load = data.moe_load
    if load is None:
        t.append("no expert loads yet (moe_load)", style="dim")
        return t
    n_exp = len(load[0])
    label_w = len(f"L{len(load) - 1}") + 1
    cols, group = heat_cells(load, max(4, width - label_w - 7))
    per = "" if group == 1 else f", {group} a cell"
    t.append(f"step {data.moe_step}: {len(load)} layers x {n_exp} experts{per}\n")
    ruler = [" "] * len(cols[0])
    for i in range(0, len(ruler), 4):
        mark = str(i * group)
        if i + len(mark) <= len(ruler):
            ruler[i : i + len(mark)] = mark
    t.append(" " * label_w + "".join(ruler) + "\n", style="dim")
    imb = data.moe_imbalance or []
    for layer, cells in enumerate(cols):
        t.append(f"L{layer}".ljust(label_w), style="dim")
        for c in cells:
            char, style, _ = SHADES[c]
            t.append(char, style=style)
        t.append(f" {fmt_imbalance(imb[layer])}" if layer < len(imb) else "")
        t.append("\n")
    for i, (char, style, what) in enumerate(SHADES):
        t.append(char, style=style)
        t.append(f" {what}" + ("\n" if i == 2 else "  "))
    t.append("of an even share; max/mean", style="dim")
    return t


def fmt_imbalance(x: float) -> str:
    return f"{x:.2f}" if math.isfinite(x) else fmt_num(x)


class HeaderBar(Widget):
    """Two fixed lines. A reactive repaints only when the text changes (rich Text
    compares text and styles), and without a layout pass: `Static.update` relayouts
    the screen, which at 1 Hz was most of the idle CPU."""

    text: reactive[Text] = reactive(Text, layout=False)

    def show(self, text: Text) -> None:
        self.text = text

    def render(self) -> Text:
        return self.text


class ConfigScreen(ModalScreen):
    """The run's resolved config.yaml, shown as written (no YAML library needed)."""

    BINDINGS = [Binding("escape,c", "dismiss", "Close")]
    DEFAULT_CSS = """
    ConfigScreen { align: center middle; }
    #config-box { width: 90%; height: 90%; border: round $accent; background: $surface; }
    #config-scroll { height: 1fr; }
    """

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.path = os.path.join(run_dir, CONFIG)

    def _content(self):
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(CONFIG_MAX + 1)
        except FileNotFoundError:
            return Text(f"{CONFIG} not found (the trainer writes it at start): {self.path}")
        except OSError as exc:
            return Text(f"{CONFIG} unreadable ({exc.strerror}): {self.path}")
        text = raw[:CONFIG_MAX].decode("utf-8", "replace")
        if len(raw) > CONFIG_MAX:
            text += "\n# ... (truncated at 1 MiB)"
        return Syntax(text, "yaml", theme="ansi_dark", line_numbers=False, word_wrap=False)

    def compose(self) -> ComposeResult:
        with Vertical(id="config-box") as box:
            box.border_title = self.path
            box.border_subtitle = "esc / c: close"
            with VerticalScroll(id="config-scroll"):
                yield Static(self._content(), id="config-text")


class MonitorApp(App):
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
