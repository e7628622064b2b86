"""Shared by the web tests: HTML pages with boilerplate around a known article body, and
WARC files written byte by byte here (not with the library under test), so the offset of
every record is known independently."""

from __future__ import annotations

import gzip
import uuid

NAV = ["Home", "World news", "Sport results", "Weather forecast", "Contact the editors"]
FOOTER = (
    "Copyright 2024 Example Media Group. All rights reserved. Privacy policy and cookie settings"
)
SIDEBAR = "Subscribe to our newsletter for daily updates and exclusive offers from our partners"
SCRIPT = "var trackingPixelPayload = {user: 'anonymous', campaign: 'spring-sale'};"

EN_BODY = [
    "The northern rivers carry meltwater from the high mountains every spring, and the floods "
    "they bring have shaped the wide valleys below for many thousands of years.",
    "In recent decades the floods have come earlier in the year, which the farmers downstream "
    "have noticed in the timing of their planting and in the yield of their fields.",
    "Hydrologists who study the basin say the change follows warmer winters, thinner snow "
    "cover and a thaw that now begins almost three weeks sooner than it did in the past.",
]
ZH_BODY = [
    "北方的河流每年春天都会带来高山上的融雪，这些洪水在数千年里塑造了下游宽阔的河谷，也养育了沿岸的村庄和城市。",
    "近几十年来，洪水到来的时间越来越早，下游的农民从播种的时间和田里的收成中都注意到了这种变化，并开始调整耕作的安排。",
    "研究这一流域的水文学家认为，这种变化与冬季变暖、积雪变薄以及融雪开始得比过去早将近三周有关，需要长期观测才能确认。",
]
MIXED_BODY = [
    "在 Linux 上安装 PyTorch 之前，先用 python -m venv .venv 创建虚拟环境，然后运行 pip install torch torchvision 安装依赖。",
    "训练脚本支持 --batch-size 和 --learning-rate 两个参数，例如 python train.py --batch-size 32 --learning-rate 3e-4，日志会写到 runs 目录。",
    "如果出现 CUDA out of memory 错误，可以减小 batch size 或者打开 gradient checkpointing，模型的 loss 曲线通常不会受到影响。",
]
DE_BODY = [
    "Die nördlichen Flüsse führen jedes Frühjahr Schmelzwasser aus den hohen Bergen, und die "
    "Hochwasser haben die weiten Täler über viele tausend Jahre geformt.",
    "In den letzten Jahrzehnten kommen die Hochwasser früher im Jahr, was die Bauern flussabwärts "
    "am Zeitpunkt der Aussaat und am Ertrag ihrer Felder bemerkt haben.",
]


def page(title: str, body: list[str], lang: str = "en") -> str:
    nav = "".join(f'<li><a href="/{i}">{n}</a></li>' for i, n in enumerate(NAV))
    paras = "".join(f"<p>{p}</p>" for p in body)
    return (
        f'<!DOCTYPE html><html lang="{lang}"><head><meta charset="utf-8"><title>{title}</title>'
        f"<script>{SCRIPT}</script><style>.nav{{color:red}}</style></head><body>"
        f'<header><nav class="nav"><ul>{nav}</ul></nav></header>'
        f'<aside class="sidebar"><p>{SIDEBAR}</p></aside>'
        f"<main><article><h1>{title}</h1>{paras}</article></main>"
        f"<footer><p>{FOOTER}</p></footer></body></html>"
    )


def http_response(body: bytes, ctype: str = "text/html; charset=utf-8", status: str = "200 OK"):
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def warc_record(url: str, payload: bytes, rtype: str = "response", n: int = 0, length=None):
    rid = f"<urn:uuid:{uuid.UUID(int=n + 1)}>"
    msg = "response" if rtype == "response" else "request"
    head = (
        f"WARC/1.0\r\nWARC-Type: {rtype}\r\nWARC-Target-URI: {url}\r\n"
        f"WARC-Date: 2024-03-0{1 + n % 9}T10:00:00Z\r\nWARC-Record-ID: {rid}\r\n"
        f"Content-Type: application/http; msgtype={msg}\r\n"
        f"Content-Length: {len(payload) if length is None else length}\r\n\r\n"
    )
    return head.encode() + payload + b"\r\n\r\n"


def write_warc(path, records: list[bytes], gz: bool) -> list[int]:
    """Write the records (each its own gzip member when `gz`); returns each one's offset."""
    offsets, pos, parts = [], 0, []
    for rec in records:
        data = gzip.compress(rec, mtime=0) if gz else rec
        offsets.append(pos)
        pos += len(data)
        parts.append(data)
    with open(path, "wb") as f:
        f.write(b"".join(parts))
    return offsets


ARTICLE_PAGES = [
    ("http://news.example.com/rivers", page("Rivers of the north", EN_BODY)),
    ("http://news.example.cn/rivers", page("北方的河流", ZH_BODY, "zh")),
    ("http://blog.example.org/pytorch", page("安装 PyTorch", MIXED_BODY, "zh")),
    ("http://zeitung.example.de/fluesse", page("Flüsse", DE_BODY, "de")),
]

# Language identification, labeled by hand: (expected language, text). Mixed Chinese /
# English technical text is labeled "zh+en": either label is right, and the two together
# must carry the score.
LABELED = [
    ("en", " ".join(EN_BODY)),
    ("en", "To install the package, open a terminal and run the installer with the default "
           "options. When it finishes, restart your shell so that the new commands are found, "
           "then check the version number to make sure everything worked as expected."),
    ("zh", " ".join(ZH_BODY)),
    ("zh", "这个城市的图书馆每天早上八点开门，周末也不休息。很多学生喜欢在安静的阅览室里复习功课，"
           "老人们则常常在报刊区读当天的新闻，馆里还经常举办讲座和展览。"),
    ("zh+en", " ".join(MIXED_BODY)),
    ("zh+en", "用 git clone 下载代码后，在 config.yaml 里设置 data_path 和 output_dir，然后执行 "
              "docker run -it --rm trainer:latest bash 进入容器，再运行 make test 检查环境是否正常。"),
    ("de", " ".join(DE_BODY)),
    ("fr", "Les rivières du nord transportent chaque printemps l'eau de fonte des hautes "
           "montagnes, et les crues qu'elles apportent ont façonné les larges vallées depuis "
           "des milliers d'années. Les agriculteurs ont remarqué que ces crues arrivent plus tôt."),
    ("es", "Los ríos del norte llevan cada primavera el agua del deshielo de las altas montañas, "
           "y las crecidas que traen han dado forma a los anchos valles durante miles de años. "
           "Los agricultores han notado que ahora llegan antes que en el pasado."),
    ("it", "I fiumi del nord portano ogni primavera l'acqua del disgelo dalle alte montagne, e "
           "le piene che arrivano hanno modellato le ampie valli per migliaia di anni. Gli "
           "agricoltori hanno notato che oggi le piene arrivano prima rispetto al passato."),
    ("nl", "De rivieren in het noorden voeren elk voorjaar smeltwater uit de hoge bergen af, en "
           "de overstromingen die ze brengen hebben de brede dalen duizenden jaren lang gevormd. "
           "De boeren stroomafwaarts merken dat het water nu eerder in het jaar komt."),
    ("pt", "Os rios do norte trazem todas as primaveras a água do degelo das altas montanhas, e "
           "as cheias que chegam moldaram os largos vales durante milhares de anos. Os "
           "agricultores notaram que as cheias agora chegam mais cedo do que no passado."),
    ("ru", "Северные реки каждую весну несут талую воду с высоких гор, и паводки, которые они "
           "приносят, тысячелетиями формировали широкие долины. Фермеры заметили, что вода "
           "теперь приходит раньше, чем в прошлом."),
    ("ja", "北の川は毎年春になると高い山から雪解け水を運び、その洪水は何千年もの間、広い谷を"
           "形作ってきた。下流の農家は、最近は水が以前より早く来ることに気づいている。"),
    ("ko", "북쪽의 강은 매년 봄 높은 산에서 눈 녹은 물을 실어 나르고, 그 홍수는 수천 년 동안 넓은 "
           "계곡을 만들어 왔다. 하류의 농부들은 요즘 물이 예전보다 일찍 온다는 것을 알아차렸다."),
]  # fmt: skip
