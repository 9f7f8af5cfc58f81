"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: it reads commands on fd 3
and writes answers on fd 4, each a JSON message ended by a NUL byte): the standard library only, no driver to
install. Used to load a page, read its DOM and type into it as a reader would.

    with Chromium(binary, tmp_path) as browser:
        page = browser.open("file:///…/leaderboard.html?mem=8")
        page.eval("document.title")
        page.type("mem", "7.5")                      # focus, select, insert text: the page's input events fire
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium_binary() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


class Chromium:
    def __init__(self, binary: str, tmp: Path, timeout: float = 60.0):
        commands_r, self._commands = os.pipe()
        self._answers, answers_w = os.pipe()
        self.timeout = timeout
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{commands_r} 4>&{answers_w}', binary, *FLAGS,
             f"--user-data-dir={tmp / 'chromium-profile'}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(commands_r, answers_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_r)
        os.close(answers_w)
        self._buffer, self._id = b"", 0

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed its pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        command = {"id": self._id, "method": method, "params": params or {}}
        if session:
            command["sessionId"] = session
        os.write(self._commands, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._message(deadline)
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        page = Page(self, self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"])
        page.wait(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")
        return page

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._commands, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass


class Page:
    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (an exception in it fails the call)."""
        result = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                        "awaitPromise": True}, self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.eval(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.05)

    def type(self, element_id: str, text: str) -> None:
        """Replace an input's text as a reader would: focus it, select what is there, insert the new text."""
        self.eval(f"(function (e) {{ e.focus(); e.select(); }})(document.getElementById({json.dumps(element_id)}))")
        if text:
            self.browser.send("Input.insertText", {"text": text}, self.session)
        else:
            self.browser.send("Input.dispatchKeyEvent", {"type": "keyDown", "key": "Delete", "code": "Delete",
                                                         "windowsVirtualKeyCode": 46}, self.session)
            self.browser.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": "Delete", "code": "Delete",
                                                         "windowsVirtualKeyCode": 46}, self.session)

    def choose(self, element_id: str, value: str) -> None:
        """Pick an option of a <select>, as a reader's choice does (its change event fires)."""
        self.eval(f"(function (e) {{ e.value = {json.dumps(value)}; e.dispatchEvent(new Event('change', "
                  f"{{bubbles: true}})); }})(document.getElementById({json.dumps(element_id)}))")

    def text(self, element_id: str) -> str:
        return self.eval(f"document.getElementById({json.dumps(element_id)}).textContent")

    def items(self, element_id: str) -> list[str]:
        return self.eval(f"Array.from(document.querySelectorAll('#{element_id} li')).map(li => li.textContent)")
