"""The monitor's widgets, messages and the watcher thread (split from `_app`)."""

from __future__ import annotations

import math
import os
import threading

from rich.syntax import Syntax
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Static
from textual_plotext import PlotextPlot

from mindloom_monitor._moe import SHADES, heat_cells
from mindloom_monitor._source import CONFIG, Batch, RunSource
from mindloom_monitor._stats import RunData, fmt_num

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
