import re
from pathlib import Path

import mindloom_parallel


def test_version_comes_from_about():
    about = (Path(mindloom_parallel.__file__).parent / "__about__.py").read_text()
    assert re.search(r'"([^"]+)"', about).group(1) == mindloom_parallel.__version__
