"""The README's Python examples run as written, and its first lines are the two commands."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert len(block) == 2
    assert block[0].startswith('pip install -e ".[dev]"') and "specjax generate" in block[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[1] in ci, "CI must run the README's test command"


def test_readme_python_examples_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md[python block {i}]", "exec"), {})
