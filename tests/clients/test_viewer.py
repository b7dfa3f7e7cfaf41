"""`sciproto view` as a real process: its JSON API over HTTP, and its page in
headless Chromium driven through the DevTools protocol (table, filters,
sorting, histogram, transcript), with a screenshot in .test-artifacts/."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sciproto.processes import sciproto_command

ARTIFACTS = Path(__file__).resolve().parents[2] / ".test-artifacts"
URL = re.compile(r"http://127\.0\.0\.1:\d+/")


def message(role: str, content: str = "", **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": [], "tool_call_id": "", "name": "", **extra}


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": json.dumps(arguments)}


def rollout(env: str, index: int, sample: int, status: str, reward: float | None, messages: list[dict[str, Any]],
            question: str, error: str | None = None) -> dict[str, Any]:
    tokens = 40 + 10 * len(messages)
    return {
        "schema": "sciproto.rollout/1", "rollout_id": f"{env}/test/{index}/{sample}", "group_id": f"{env}/test/{index}",
        "env": env, "split": "test", "index": index, "sample": sample, "task": {"question": question},
        "status": status, "reward": reward, "reward_components": {"correct": reward} if status != "INFRA_ERROR" else {},
        "reward_detail": "", "terminated": status != "INFRA_ERROR", "truncated": False,
        "steps": sum(m["role"] == "assistant" for m in messages), "messages": messages,
        "token_ids": list(range(tokens)), "loss_mask": [1] * tokens, "logprobs": [-0.5] * tokens,
        "version_spans": [[0, tokens, 3]], "tokens": {"prompt": tokens - 12, "completion": 12},
        "policy_version": {"min": 3, "max": 3}, "seconds": 0.5 + index, "trace_id": "", "error": error,
        "finished_at": "2025-01-01T00:00:00Z",
    }


SYSTEM = message("system", "Solve the problem. Use the tools; submit the final number with submit_answer.")
QUESTIONS = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. "
              "How many clips did she sell in May?"),
             "Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes of babysitting. How much did she earn?",
             "Betty needs $100 for a wallet and has half of it. How much more does she need?"]


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


# A message with an image, as the notebook environment sends a figure (MessageRecord.parts).
IMAGE_PARTS = [{"type": "text", "text": "Say hi."},
               {"type": "image", "mime_type": "image/png", "data_base64": base64.b64encode(png(6, 4)).decode()}]


def rollouts() -> list[dict[str, Any]]:
    with_tools = [
        SYSTEM, message("user", QUESTIONS[0]),
        message("assistant", "Half of 48 is what she sold in May.",
                tool_calls=[tool_call("call_1", "calculator", {"expression": "48 / 2"})]),
        message("tool", "24.0", tool_call_id="call_1", name="calculator"),
        message("assistant", "", tool_calls=[tool_call("call_2", "submit_answer", {"answer": "24"})]),
        message("tool", "Correct.", tool_call_id="call_2", name="submit_answer"),
    ]
    wrong = [SYSTEM, message("user", QUESTIONS[0]),
             message("assistant", "", tool_calls=[tool_call("call_1", "submit_answer", {"answer": "96"})]),
             message("tool", "Incorrect.", tool_call_id="call_1", name="submit_answer")]
    weng = [SYSTEM, message("user", QUESTIONS[1]),
            message("assistant", "", tool_calls=[tool_call("call_1", "submit_answer", {"answer": "10"})]),
            message("tool", "Correct.", tool_call_id="call_1", name="submit_answer")]
    return [
        rollout("gsm8k", 0, 0, "SCORED", 1.0, with_tools, QUESTIONS[0]),
        rollout("gsm8k", 0, 1, "SCORED", 0.0, wrong, QUESTIONS[0]),
        rollout("gsm8k", 1, 0, "SCORED", 1.0, weng, QUESTIONS[1]),
        rollout("toy", 1, 0, "UNSCORED", 0.25, [SYSTEM, message("user", "Say hi.", parts=IMAGE_PARTS),
                                                message("assistant", "hi")], "Say hi."),
    ]


# collect writes 0.0 as a placeholder reward; the viewer must not count it
FAILURE = rollout("gsm8k", 2, 0, "INFRA_ERROR", 0.0, [SYSTEM, message("user", QUESTIONS[2])], QUESTIONS[2],
                  error="UNAVAILABLE: environment server 127.0.0.1:50051 unreachable after 4 attempts")


def write_jsonl(path: Path, records: list[dict[str, Any]], tail: str = "") -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + tail, encoding="utf-8")


class Viewer:
    """`sciproto view FILE --port 0` in a child process, and the URL it printed."""

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen([*sciproto_command("view", str(path), "--port", "0")], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.process.stdout or ()], daemon=True).start()
        deadline, seen = time.monotonic() + 60, []
        while (match := URL.search("".join(seen))) is None:
            try:
                seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                self.stop()
                raise AssertionError(f"the viewer printed no URL within 60 s: {''.join(seen)!r}") from None
        self.url = match.group(0)
        self.printed = "".join(seen)

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.url + path.lstrip("/"), timeout=10) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def rollouts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("view") / "out.jsonl"
    write_jsonl(path, rollouts(), tail="this line is not json\n")
    write_jsonl(path.with_name("out.failures.jsonl"), [FAILURE])
    return path


@pytest.fixture(scope="module")
def viewer(rollouts_file: Path) -> Iterator[Viewer]:
    running = Viewer(rollouts_file)
    yield running
    assert running.stop() == 0, "the viewer should exit cleanly on SIGTERM"


def test_api_pages_rows_of_both_files_and_reports_bad_lines(viewer: Viewer) -> None:
    assert "out.failures.jsonl" in viewer.printed
    status, first = viewer.get("/api/rollouts?offset=0&limit=3")
    assert status == 200 and first["total"] == 5 and first["next_offset"] == 3
    _, rest = viewer.get("/api/rollouts?offset=3&limit=3")
    assert rest["next_offset"] is None
    rows = first["rows"] + rest["rows"]
    assert [row["status"] for row in rows] == ["SCORED", "SCORED", "SCORED", "UNSCORED", "INFRA_ERROR"]
    assert rows[0]["tools"] == ["calculator", "submit_answer"] and rows[0]["tokens"] == 100
    assert rows[4]["key"] == "failures:1" and "unreachable" in rows[4]["error"] and rows[4]["reward"] is None
    _, summary = viewer.get("/api/summary")
    assert summary["problems"] == ["out.jsonl line 5: not JSON (Expecting value: line 1 column 1 (char 0))"]


def test_api_serves_one_rollout_without_its_token_arrays(viewer: Viewer) -> None:
    status, record = viewer.get("/api/rollout?key=rollouts:1")
    assert status == 200
    assert record["messages"][3] == message("tool", "24.0", tool_call_id="call_1", name="calculator")
    assert "token_ids" not in record and record["token_counts"] == {"token_ids": 100, "loss_mask": 100, "logprobs": 100}


def test_api_errors_say_what_to_send(viewer: Viewer) -> None:
    status, body = viewer.get("/api/rollout?key=rollouts:99")
    assert status == 404 and "has no line 99" in body["error"]
    status, body = viewer.get("/api/rollout?key=nonsense")
    assert status == 404 and "rollouts:12" in body["error"]
    status, body = viewer.get("/api/rollouts?limit=lots")
    assert status == 400 and "limit='lots' is not an integer" in body["error"]


def test_appended_lines_appear_and_partial_lines_wait(tmp_path: Path) -> None:
    path = tmp_path / "growing.jsonl"
    first, second, *_ = rollouts()
    write_jsonl(path, [first])
    running = Viewer(path)
    try:
        with path.open("a") as stream:
            stream.write(json.dumps(second)[:40])  # a line still being written
            stream.flush()
            assert running.get("/api/rollouts?offset=0")[1]["total"] == 1
            stream.write(json.dumps(second)[40:] + "\n")
        assert [row["sample"] for row in running.get("/api/rollouts?offset=0")[1]["rows"]] == [0, 1]
    finally:
        assert running.stop() == 0


def test_missing_file_is_refused_with_a_hint(tmp_path: Path) -> None:
    result = subprocess.run(sciproto_command("view", str(tmp_path / "absent.jsonl"), "--port", "0"),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "sciproto collect" in result.stderr


# ---- the page in headless Chromium ---------------------------------------------------------------


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


class DevTools:
    """The few Chrome DevTools Protocol calls the test needs, on one page."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self.socket = socket
        self.last_id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.last_id += 1
        call_id = self.last_id
        await self.socket.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(30):
            while True:  # events arrive in between; only our answer matters
                answer = await self.socket.receive_json()
                if answer.get("id") == call_id:
                    if "error" in answer:
                        raise RuntimeError(f"{method} failed: {answer['error']}")
                    return answer["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"still false after {timeout_s:.0f} s: {expression}")
            await asyncio.sleep(0.1)
        return value

    async def click(self, selector: str) -> None:
        """A real mouse click at the middle of the first element matching `selector`."""
        box = await self.evaluate(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
            return {{x: r.x + r.width / 2, y: r.y + r.height / 2}}; }})()""")
        assert box, f"nothing on the page matches {selector}"
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    async def type(self, selector: str, text: str) -> None:
        await self.click(selector)
        await self.call("Input.insertText", text=text)


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0", "--window-size=1440,900", "--hide-scrollbars"]


@pytest.fixture
def chromium() -> Iterator[str]:
    """The DevTools websocket URL of a page in a fresh headless Chromium."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium found (install Debian's `chromium`; scripts/test.sh does): the page is not tested")
    # its own session, so that stopping it stops its renderer and helper processes too
    with tempfile.TemporaryDirectory(prefix="viewer-chromium-", ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            yield page_socket_url(Path(profile) / "DevToolsActivePort", process)
        finally:
            stop_process_group(process)


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def page_socket_url(port_file: Path, process: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text().strip()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"Chromium did not open its DevTools port (exit code {process.poll()})")
        time.sleep(0.1)
    port = port_file.read_text().split()[0]
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            pages = [target for target in json.load(response) if target["type"] == "page"]
        if pages:
            return pages[0]["webSocketDebuggerUrl"]
        if time.monotonic() > deadline:
            raise AssertionError("Chromium has no page to drive")
        time.sleep(0.1)


ROWS = "document.querySelectorAll('#rollouts tbody tr').length"
CELLS = "[...document.querySelectorAll('#rollouts tbody tr')].map(tr => tr.children[{column}].textContent)"


async def test_page_shows_filters_sorts_and_opens_transcripts(viewer: Viewer, chromium: str) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(chromium, max_msg_size=0) as socket:
        page = DevTools(socket)
        await page.call("Page.enable")
        await page.call("Emulation.setDeviceMetricsOverride", width=1440, height=900, deviceScaleFactor=1, mobile=False)
        await page.call("Page.navigate", url=viewer.url)
        await page.wait_for("document.body?.dataset.ready === 'true'")

        assert await page.evaluate(ROWS) == 5
        assert "line 5: not JSON" in await page.evaluate("document.querySelector('#problems').textContent")
        bars = await page.evaluate("[...document.querySelectorAll('#histogram rect.bar')].map(b => [+b.dataset.low, +b.dataset.count])")
        assert sorted(bars) == [[0.0, 1], [0.25, 1], [1.0, 2]]  # the INFRA_ERROR rollout has no reward

        await page.click("th[data-sort=reward]")  # numbers sort largest first on the first click
        assert await page.evaluate(CELLS.format(column=3)) == ["1.0", "1.0", "0.25", "0.0", "–"]
        await page.click("th[data-sort=reward]")
        assert (await page.evaluate(CELLS.format(column=3)))[:3] == ["0.0", "0.25", "1.0"]

        await page.click("#status-INFRA_ERROR")
        assert await page.evaluate(ROWS) == 4
        await page.click("#histogram rect.bar[data-low='1']")  # a bar sets the reward range
        assert await page.evaluate(ROWS) == 2
        await page.type("#search", "calculator")
        assert await page.evaluate(CELLS.format(column=0)) == ["gsm8k/test/0/0"]

        await page.click("#rollouts tbody tr")
        await page.wait_for("document.querySelector('.transcript') !== null")
        transcript = await page.evaluate("""({
            roles: [...document.querySelectorAll('.message')].map(m => m.className),
            calls: [...document.querySelectorAll('.tool-call .tool-name')].map(e => e.textContent),
            arguments: document.querySelector('.tool-call .arguments').textContent,
            outputs: [...document.querySelectorAll('pre.tool-output')].map(e => e.textContent),
            outputFont: getComputedStyle(document.querySelector('pre.tool-output')).fontFamily,
        })""")
        assert transcript["roles"] == ["message role-system", "message role-user", "message role-assistant",
                                       "message role-tool", "message role-assistant", "message role-tool"]
        assert transcript["calls"] == ["calculator", "submit_answer"]
        assert transcript["arguments"] == '{\n  "expression": "48 / 2"\n}'
        assert transcript["outputs"] == ["24.0", "Correct."]
        assert "mono" in transcript["outputFont"].lower()

        await page.click("#clear")  # the open transcript stays; its row is marked in the full table
        assert await page.evaluate(ROWS) == 5
        assert await page.evaluate("document.querySelector('tr.selected').dataset.key") == "rollouts:1"
        ARTIFACTS.mkdir(exist_ok=True)
        shot = await page.call("Page.captureScreenshot", format="png")
        (ARTIFACTS / "viewer.png").write_bytes(base64.b64decode(shot["data"]))

        await page.type("#search", "unreachable")
        await page.click("#rollouts tbody tr")
        error = await page.wait_for("document.querySelector('.detail-pane .error-box')?.textContent")
        assert "unreachable after 4 attempts" in error
        await page.wait_for("document.querySelector('.detail-header .badge')?.textContent === 'INFRA_ERROR'")
        assert await page.evaluate("document.querySelector('.detail-reward').textContent") == "no reward"
        shot = await page.call("Page.captureScreenshot", format="png")
        (ARTIFACTS / "viewer-infra-error.png").write_bytes(base64.b64decode(shot["data"]))
    assert (ARTIFACTS / "viewer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_page_shows_image_parts(viewer: Viewer, chromium: str) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(chromium, max_msg_size=0) as socket:
        page = DevTools(socket)
        await page.call("Page.enable")
        await page.call("Page.navigate", url=viewer.url)
        await page.wait_for("document.body?.dataset.ready === 'true'")
        await page.type("#search", "Say hi")
        await page.click("#rollouts tbody tr")
        size = await page.wait_for("(() => { const img = document.querySelector('.image-part img');"
                                   " return img && img.complete && img.naturalWidth ? [img.naturalWidth, img.naturalHeight] : null; })()")
    assert size == [6, 4]
