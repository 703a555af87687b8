"""e2b-code-interpreter's rich results on the code-interpreter image (images/build.sh code-interpreter: numpy,
pandas, matplotlib): a DataFrame as HTML, a matplotlib figure as a PNG that decodes. Configured as test_sdk.py is;
the daemon's e2b.code_interpreter_image is that image (sandboxd/tests/suite/e2b_sdk.rs).
"""

import base64
import struct
import zlib

import pytest
from e2b_code_interpreter import Sandbox

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def sbx():
    s = Sandbox.create()
    yield s
    s.kill()


def png_size(data):
    """The width and height of a PNG, once its chunks check out (signature, IHDR, every CRC, IEND)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, size, seen_end = 8, None, False
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        if kind == b"IEND":
            seen_end = True
        pos += 12 + length
    assert seen_end and size, "no IHDR or IEND"
    return size


def test_a_dataframe_is_html(sbx):
    r = sbx.run_code("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\ndf")
    assert r.error is None, r.error
    main = [x for x in r.results if x.is_main_result]
    assert main and main[0].html and "<table" in main[0].html, r.results
    assert "a" in main[0].text and "x" in main[0].text


def test_a_matplotlib_figure_is_a_png_that_decodes(sbx):
    r = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()")
    assert r.error is None, r.error
    pngs = [x.png for x in r.results if x.png]
    assert len(pngs) == 1, r.results
    width, height = png_size(base64.b64decode(pngs[0]))
    assert width > 100 and height > 100, (width, height)
    # Shown once: the next cell has no figure left over.
    assert not [x for x in sbx.run_code("1").results if x.png]


def test_numpy_state_carries_over(sbx):
    sbx.run_code("import numpy as np\na = np.arange(10)")
    assert sbx.run_code("int(a.sum())").text == "45"
