"""The README and the docs site: the site builds with warnings as errors (broken links and
anchors fail), the generated reference pages are current, the README stays a landing page whose
status table is the status page's and whose quick-start commands are the ones CI runs, the
getting-started example runs, every ``tidekv`` command line of the pages runs here (or names
why it cannot), and no page names an internal issue or a development machine's path."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tidekv.bench.ports import free_port

from tests.childproc import REPO_ROOT
from tests.store.procs import wait_until

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
MARKERS = ("<!-- status-table: begin -->", "<!-- status-table: end -->")


def _between(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) + len(begin):text.index(end)]


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs is not None, "mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)"
    result = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                               "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text().count("doc-heading") > 20, \
        "the Python API page rendered no docstrings"


@pytest.mark.parametrize("script", ["gen_reference.py", "gen_benchmarks.py"])
def test_generated_pages_are_current(script: str) -> None:
    result = subprocess.run([sys.executable, str(DOCS / script), "--check"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_readme_is_a_landing_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    status = (DOCS / "status.md").read_text()
    assert _between(text, *MARKERS) == _between(status, *MARKERS), \
        "README's status table and docs/status.md differ: the status page is the one source, copy it"


def test_quick_start_commands_are_what_ci_runs() -> None:
    commands = [block.strip() for block in _code_blocks(README.read_text(), "bash")
                if block.strip().startswith("python3 -m venv .venv")]
    assert len(commands) == 2, commands
    assert commands[0].endswith("tidekv up")
    ci = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, "the README's test command is not a line of .ci/run"
    getting_started = (DOCS / "getting-started.md").read_text()
    assert all(c in getting_started for c in commands), "getting-started.md's quick start differs from the README's"


def test_getting_started_example_runs(tmp_path: Path) -> None:
    [example] = [b for b in _code_blocks((DOCS / "getting-started.md").read_text(), "python") if "Store.connect" in b]
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "tidekv.cli", "up", "--port", str(port), "--segment-size", "64MiB",
                           "--metrics-port", "0"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    try:
        import socket

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(listening, 30.0, "tidekv up to listen")
        script = example.replace("127.0.0.1:50051", f"127.0.0.1:{port}")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[True, False]", result.stdout
    finally:
        up.terminate()
        up.wait(timeout=30)


_READER_PAGES = [README, *sorted((DOCS / "guides").glob("*.md")), *sorted((DOCS / "operations").glob("*.md")),
                 DOCS / "getting-started.md", DOCS / "index.md", DOCS / "concepts.md", DOCS / "status.md"]


@pytest.mark.parametrize("page", [README, *sorted(p for p in DOCS.rglob("*.md") if p.name != "benchmark-history.md")],
                         ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_internal_references(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"\bissues? #?\d+\b", text, flags=re.I), "names an issue readers cannot see"
    assert "/work/" not in text and "/tmp/ci" not in text, "names a path of a development machine"


@pytest.mark.parametrize("page", _READER_PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_dated_runs_outside_the_benchmark_pages(page: Path) -> None:
    """Dated measurements live on the benchmark pages; the status table's dates are its own."""
    text = page.read_text()
    if page.name in ("status.md", "README.md"):
        text = text.replace(_between(text, *MARKERS), "")
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text), "move dated runs to a page under docs/benchmarks/"


def test_every_error_class_is_in_the_catalogue() -> None:
    import inspect

    from tidekv import errors

    catalogue = (DOCS / "operations" / "troubleshooting.md").read_text()
    classes = [name for name, c in vars(errors).items()
               if inspect.isclass(c) and issubclass(c, errors.TidekvError) and c.__module__ == errors.__name__
               and c is not errors.TidekvError]
    missing = [name for name in classes if f"| `{name}` |" not in catalogue]
    assert not missing, f"add these to the error table of docs/operations/troubleshooting.md: {missing}"


def _fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    language: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence:
            out.append((language, lines))
            language = None
        elif language is not None:
            lines.append(line)
    return out


def _commands(page: Path, program: str) -> list[str]:
    """The command lines of ``program`` (a regex of its name) in a page's shell blocks (a block
    with ``$`` prompts: only the prompted lines), from the program's name on, without environment
    assignments, comments, pipes or redirections."""
    commands = []
    for language, lines in _fenced_blocks(page.read_text()):
        if language not in ("", "bash", "sh", "console", "shell"):
            continue
        text = "\n".join(lines).replace("\\\n", " ")
        prompted = any(re.match(r"^\s*\w*\$ ", line) for line in text.splitlines())
        for line in text.splitlines():
            if prompted:
                prompt = re.match(r"^\s*\w*\$ (.*)", line)
                if prompt is None:
                    continue
                line = prompt.group(1)
            found = re.search(rf"(?:^|&& |; )\s*(?:\w+=\S+ )*(?:\S*/)?((?:{program})(?: .*|$))", line)
            if found is not None:
                command = re.split(r"\s+#", found.group(1))[0].strip()
                commands.append(re.split(r" \| | && | > | >> |; | 2>", command)[0])
    return commands


def _tidekv_commands(page: Path) -> list[str]:
    """The ``tidekv ...`` command lines of a page, without the ``tidekv``."""
    return [c[len("tidekv "):] for c in _commands(page, "tidekv") if c.startswith("tidekv ")]


def test_every_tidekv_command_in_the_docs_parses() -> None:
    """Each ``tidekv`` command line a page shows is accepted by the command's own parser, so a
    renamed or removed flag fails here instead of in a reader's terminal."""
    import contextlib
    import io
    import shlex

    from tidekv.cli import build_parser

    failures, seen = [], 0
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        for command in _tidekv_commands(page):
            args, errors = shlex.split(command), io.StringIO()
            seen += 1
            try:
                with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                    build_parser(args).parse_args(args)
            except SystemExit as exc:
                if exc.code not in (0, None):
                    failures.append(f"{page.relative_to(REPO_ROOT)}: tidekv {command}: {errors.getvalue().strip()}")
    assert seen > 20, f"found only {seen} tidekv commands in the docs: the extraction is broken"
    assert not failures, "\n".join(failures)


_NOT_RUN = (
    (r"^bench\b", "a benchmark of minutes (the Mooncake comparisons need its wheel); tests/bench runs each bench "
                  "small"),
    (r"10\.0\.0\.\d+", "names other hosts' addresses; tests/multihost runs the same across network namespaces"),
    (r"/nvme", "needs the NVMe directories it names; tests/store/test_disk_tier.py runs the disk tier here"),
    (r"--segment-size (?:[5-9]|\d\d+)GiB", "needs more memory than a test machine has"),
    (r"master\.pem", "needs the certificate the page makes a step before; tests/store/test_tls.py runs TLS"),
    (r"tenants\.toml", "needs the page's tenants file; tests/store/test_tenants.py runs tenants"),
)
"""Command lines of the docs this machine cannot run as written, and why (each pattern must
still match some page's command: a stale entry fails the test)."""

_SERVERS = {"up": "tidekv is up", "master": "listening on", "proxy": "listening"}
"""Commands that serve until stopped: run until they print that they are ready, then stopped."""
_DEFAULT_PORTS = {"up": {"--port": 50051, "--metrics-port": 9003}, "master": {"--port": 50051, "--metrics-port": 9003},
                  "proxy": {"--port": 8000}}


def _wait_for_ports(args: list[str], timeout_s: float = 60.0) -> None:
    """Waits until the fixed ports a server command binds are free (another test may hold one
    for a moment), so that the command runs as written."""
    import socket

    ports = dict(_DEFAULT_PORTS.get(args[0], {}))
    for flag in list(ports):
        if flag in args and args.index(flag) + 1 < len(args):
            ports[flag] = int(args[args.index(flag) + 1])

    def free() -> bool:
        for port in ports.values():
            if port <= 0:
                continue
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    return False
        return True

    wait_until(free, timeout_s, f"ports {sorted(ports.values())} to be free for tidekv {' '.join(args)}")


def _ready(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> str:
    """Output of ``proc`` until a line holds ``needle`` (or it exits, or the time is up)."""
    import selectors
    import time

    # Raw reads of the pipe: a buffered readline() after select() would leave a second line that
    # came in the same read in its buffer, where select() no longer sees it.
    seen = b""
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.2):
            seen += os.read(fd, 65536)
            if needle.encode() in seen:
                break
    return seen.decode(errors="replace")


def _stop(proc: subprocess.Popen[str]) -> None:
    """Ends a command a test ran: asked to stop, killed if it does not within 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_every_tidekv_command_in_the_guides_runs_or_says_why_not(tmp_path: Path) -> None:
    """Each ``tidekv`` command line of the README and the docs runs here as written: a server
    until it says it is ready, any other command to a zero exit; one that cannot run here names
    why in ``_NOT_RUN``. ``trace analyze`` runs on a stand-in trace file of the name it gives."""
    import shlex

    from tests.trace.traces import HAND, write_trace

    commands = sorted({c for page in [README, *sorted(DOCS.rglob("*.md"))] for c in _tidekv_commands(page)})
    used: set[str] = set()
    failures, ran = [], 0
    for command in commands:
        why = next((p for p, _ in _NOT_RUN if re.search(p, command)), None)
        if why is not None:
            used.add(why)
            continue
        args = shlex.split(command)
        work = tmp_path / f"run{ran}"
        work.mkdir()
        for word in args:
            if word.endswith(".jsonl") and args[:2] == ["trace", "analyze"]:
                write_trace(work / word, HAND)
        ran += 1
        if args[0] in _SERVERS:
            _wait_for_ports(args)
        proc = subprocess.Popen([sys.executable, "-m", "tidekv.cli", *args], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            needle = _SERVERS.get(args[0])
            if needle is not None:
                out = _ready(proc, needle, 60.0)
                if needle not in out:
                    failures.append(f"tidekv {command}: never said {needle!r}:\n{out[-2000:]}")
            else:
                out, _ = proc.communicate(timeout=120)
                if proc.returncode != 0:
                    failures.append(f"tidekv {command}: exit {proc.returncode}:\n{out[-2000:]}")
        finally:
            _stop(proc)
    assert ran >= 5, f"ran only {ran} of {len(commands)} commands: the classification is too broad"
    assert not failures, "\n\n".join(failures)
    stale = [p for p, _ in _NOT_RUN if p not in used]
    assert not stale, f"no command of the docs matches these _NOT_RUN entries any more: {stale}"


_ENGINES = r"vllm serve|python3? -m (?:vllm|sglang|sglang_router)\.\S+|trtllm-serve|mooncake_\w+"
"""The engines' and Mooncake's commands the guides show, beside tidekv's own."""
_ENGINE_RUN = {"mooncake_master": ("tidekv.compat.mooncake_master", "listening on"),
               "mooncake_http_metadata_server": ("tidekv.compat.mooncake_metadata_server", "serving")}
"""Engine commands this machine runs as written (tidekv's drop-in serves them): until ready."""
_ENGINE_NOT_RUN = (
    (r"^(?:vllm serve|python3? -m vllm\.)", "serves a model of the reader's (`M`, `...`), whose weights a test "
                                           "does not have; the vLLM job (integration/) runs vLLM's engine and its "
                                           "OpenAI server on this machine's CPU with tidekv's connector"),
    (r"^python3? -m sglang", "an SGLang server needs a GPU; the SGLang job (integration/sglang) runs tidekv's "
                            "backends against SGLang's own classes"),
    (r"^trtllm-serve", "needs TensorRT-LLM and a GPU; tests/trtllm runs the C ABI it loads"),
    (r"^mooncake_client", "contributes a 4 GB segment, more memory than a test takes; tests/compat runs "
                          "mooncake_client with a small one"),
)
"""Engine command lines that cannot run here, and why (a stale entry fails the test)."""


def test_every_engine_command_in_the_guides_runs_or_says_why_not(tmp_path: Path) -> None:
    """Each engine or Mooncake command line of the README and the docs either runs here as written
    (tidekv's drop-in commands, until they say they serve) or names why not in
    ``_ENGINE_NOT_RUN``: a new command line in a guide fails here until it is one or the other."""
    import shlex

    commands = sorted({c for page in [README, *sorted(DOCS.rglob("*.md"))] for c in _commands(page, _ENGINES)})
    assert len(commands) >= 10, f"found only {len(commands)} engine commands in the docs: the extraction is broken"
    used: set[str] = set()
    unclassified, failures, ran = [], [], 0
    for command in commands:
        why = next((p for p, _ in _ENGINE_NOT_RUN if re.search(p, command)), None)
        if why is not None:
            used.add(why)
            continue
        args = shlex.split(command)
        if args[0] not in _ENGINE_RUN:
            unclassified.append(command)
            continue
        module, needle = _ENGINE_RUN[args[0]]
        ran += 1
        if args[0] == "mooncake_master":
            _wait_for_ports(["master"])  # (its --rpc_port is the master's default, 50051)
        code = f"import sys; from {module} import main; sys.exit(main(sys.argv[1:]))"
        proc = subprocess.Popen([sys.executable, "-c", code, *args[1:]], cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            out = _ready(proc, needle, 60.0)
            if needle not in out:
                failures.append(f"{command}: never said {needle!r}:\n{out[-2000:]}")
        finally:
            _stop(proc)
    assert not unclassified, f"engine command lines neither run here nor said why not (_ENGINE_NOT_RUN): {unclassified}"
    assert ran >= 1 and not failures, "\n\n".join(failures)
    stale = [p for p, _ in _ENGINE_NOT_RUN if p not in used]
    assert not stale, f"no command of the docs matches these _ENGINE_NOT_RUN entries any more: {stale}"


def test_every_metric_a_page_names_is_in_the_metrics_reference() -> None:
    """A metric a guide tells readers to watch exists under that name: each ``tidekv_*`` (or
    ``vllm:tidekv_*``) name in backticks on a page is one the generated metrics reference lists
    (``{a,b}`` expanded; a trailing ``*`` or a leading ``...`` matches by prefix or suffix)."""
    reference = (DOCS / "reference" / "metrics.md").read_text()
    known = set(re.findall(r"`((?:vllm:)?tidekv_\w+)`", reference))
    assert len(known) > 40, "the metrics reference lists too few metrics: its format changed"
    not_metrics = {"tidekv_last_error", "tidekv_update_weights", "tidekv_version"}
    unknown, seen = [], 0
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        if page.parent.name == "reference" or "benchmarks" in page.parts:
            continue
        for quoted in re.findall(r"`([^`\n]*tidekv_[^`\n]*)`", page.read_text()):
            # a name ends where its labels start ({reason="..."}); braces inside it list alternatives
            for name in re.findall(r"(?<![\w.])(?:vllm:)?(?:\.\.\.)?tidekv_\w*(?:\{[\w,]+\}\w+)*\*?", quoted):
                base = re.sub(r"\{[^}]*\}.*", "", name)
                if base in not_metrics or re.match(r"tidekv_(?:vllm|sglang|trtllm|mooncake|weights)(?:_|$)", base):
                    continue
                seen += 1
                alternatives = re.search(r"\{([^}]*)\}(\w*)", name)
                names = ([base + a + alternatives.group(2) for a in alternatives.group(1).split(",")]
                         if alternatives else [name])
                for n in names:
                    if n.endswith("*"):
                        ok = any(k.startswith(n[:-1]) for k in known)
                    elif n.startswith("..."):
                        ok = any(k.endswith(n[3:]) for k in known)
                    else:
                        ok = n in known
                    if not ok:
                        unknown.append(f"{page.relative_to(REPO_ROOT)}: {n}")
    assert seen > 15, f"found only {seen} metric names on the pages: the extraction is broken"
    assert not unknown, "metrics named on pages but absent from docs/reference/metrics.md:\n" + "\n".join(unknown)
