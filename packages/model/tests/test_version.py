import re
from pathlib import Path

import mindloom_model


def test_version_comes_from_about():
    about = (Path(mindloom_model.__file__).parent / "__about__.py").read_text()
    assert re.search(r'"([^"]+)"', about).group(1) == mindloom_model.__version__
