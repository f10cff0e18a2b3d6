"""The approver's path in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`, driven
by Selenium) against the real `mlflow server` the tests start on loopback.

One release of the tiny model becomes version 1; a real `enginewright promote` waits for its approval and
prints the link; the browser opens that link, reads the gate verdicts on the version page and approves
with the page's own tag editor (typing `approved_by` and `approval`, clicking Add); promote finishes and
version 1 is live. A second release (version 2, whose page compares it with version 1) is rejected the
same way: promote exits with the gate code and says that nothing changed and version 1 stays live. Then
the page's link to the release report opens MLflow's artifact viewer, whose HTML preview must show the
report with its plots (images decoded, non-zero natural width).

On failure each step saves a screenshot, the page source and the promote output under
`.ci/artifacts/browser/` (ignored by git; CI keeps `.ci/artifacts/`). `make test` installs Chromium with
apt-get when it is missing; the module skips, saying why, only where that was impossible.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from flows.cli import EXIT_GATE
from flows.release import ReleaseResult, release_flow
from flows.spec import parse_spec
from registry import model_registry as mr
from serving.triton.process import start_triton
from serving.triton.repository import init_repository, router_weights
from tasks.served_config import IGNORED_GENERATION_KEYS
from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no headless Chromium here (`chromium` and `chromedriver` not on PATH) and `make test` could not "
                "install the Debian packages chromium + chromium-driver (apt-get needs root)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test dependency: run `make test`")
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

EVIDENCE = Path(__file__).resolve().parents[1] / ".ci" / "artifacts" / "browser"
UI_WAIT_S = 30
PROMOTE_START_S = 120  # imports of torch, Prefect and MLflow on a busy 2-core machine
PROMOTE_FINISH_S = 180


# -- the browser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,1200"):
        options.add_argument(arg)
    # the driver path is given, so Selenium Manager downloads nothing
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def evidence(driver: webdriver.Chrome, name: str, promote: Promote | None = None) -> Iterator[None]:
    """On any failure inside: save every tab's screenshot and page source (and promote's output), re-raise."""
    try:
        yield
    except BaseException:
        EVIDENCE.mkdir(parents=True, exist_ok=True)
        for i, handle in enumerate(driver.window_handles):
            driver.switch_to.window(handle)
            driver.save_screenshot(str(EVIDENCE / f"{name}-tab{i}.png"))
            (EVIDENCE / f"{name}-tab{i}.html").write_text(driver.page_source)
        if promote is not None:
            (EVIDENCE / f"{name}-promote.txt").write_text(promote.output())
        print(f"browser evidence in {EVIDENCE}", file=sys.stderr)
        raise


def wait(driver: webdriver.Chrome, timeout_s: float = UI_WAIT_S) -> WebDriverWait:
    return WebDriverWait(driver, timeout_s)


def description_text(driver: webdriver.Chrome, contains: str) -> str:
    """The rendered description of the version page, once it shows `contains`."""
    page = (By.CSS_SELECTOR, "[data-testid='note-editor-preview-content']")
    wait(driver).until(ec.text_to_be_present_in_element(page, contains))
    return driver.find_element(*page).text


def add_tag_in_ui(driver: webdriver.Chrome, name: str, value: str) -> None:
    """Type a tag into the version page's tag editor and click Add, as a person does; wait until it is listed."""
    name_box = wait(driver).until(ec.element_to_be_clickable((By.CSS_SELECTOR, "input[aria-label='tag name']")))
    form = name_box.find_element(By.XPATH, "./ancestor::form")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", form)
    name_box.click()
    name_box.send_keys(name)
    value_box = form.find_element(By.CSS_SELECTOR, "input[aria-label='tag value']")
    value_box.click()
    value_box.send_keys(value)
    form.find_element(By.XPATH, ".//button[normalize-space()='Add']").click()
    listed = f"//td[normalize-space()='{name}']/following-sibling::td[normalize-space()='{value}']"
    wait(driver).until(ec.presence_of_element_located((By.XPATH, listed)))


# -- a real `enginewright promote` ---------------------------------------------------------------------


@dataclass
class Promote:
    """`enginewright promote` in a session of its own; its stdout read line by line in a thread."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, spec_path: Path, version: str, env: dict[str, str]) -> Promote:
        cli = Path(sys.executable).parent / "enginewright"
        proc = subprocess.Popen([str(cli), "promote", str(spec_path), "--version", version], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env,
                                cwd=spec_path.parent)
        promote = cls(proc)
        threading.Thread(target=promote._read, daemon=True).start()
        return promote

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def link(self) -> str:
        """The version page's link from the 'waiting up to ... open <url> and ...' line."""
        deadline = time.monotonic() + PROMOTE_START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in list(self.lines):
                if line.startswith("waiting up to"):
                    found = re.search(r" open (\S+) and ", line)
                    assert found, line
                    return found.group(1)
            time.sleep(0.1)
        raise AssertionError(f"promote printed no approval link within {PROMOTE_START_S} s:\n{self.output()}")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=PROMOTE_FINISH_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"promote still running after {PROMOTE_FINISH_S} s:\n{self.output()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# -- the release set-up: one MLflow server, one Triton, one tiny model released twice ----------------------


@dataclass
class Setup:
    tmp: Path
    checkpoint: Path
    tracking_uri: str
    model: str
    triton_url: str
    repository: Path
    promote_env: dict[str, str]
    released: list[str] = field(default_factory=list)

    def spec(self, max_batch_size: int, *, checkpoint: Path | None = None, served: dict | None = None) -> dict:
        """The release/promote spec; a new max batch gives a new engine fingerprint, hence a new version."""
        return {
            "source": {"checkpoint": str(checkpoint or self.checkpoint)},
            **({"served": served} if served else {}),
            "engine": {"dtype": "float32", "max_batch_size": max_batch_size, "max_input_len": 64, "max_seq_len": 128},
            "validation": {"max_new_tokens": 8, "prompts": ["The capital of France is", "Once upon a time"]},
            # the A/B against production is not what this test judges (tests/test_gates.py does): on three busy
            # xdist workers a 4-round A/B of the b8 engine against the b4 one once read 0.24x and refused
            "perf": {"batch_size": 2, "input_len": 8, "output_len": 4, "iterations": 2, "max_slowdown": 0.95},
            "mlflow": {"tracking_uri": self.tracking_uri, "model_name": self.model},
            "artifacts": {"uri": (self.tmp / "artifacts").as_uri()},
            "approval": {"mode": "mlflow-tag", "timeout_s": 300, "poll_s": 0.5},
            # the Triton side as cheap as it goes (it is not what this test is about): one llm model, no stream
            # model, one warm-up request, straight to full weight (the first live version has nothing to compare with)
            "triton": {"endpoints": [{"url": self.triton_url, "model_repository": str(self.repository)}],
                       "engine_parameters": {"decoupled": "false"}, "warmup_requests": 1},
            "rollout": {"steps": [{"set_weight": 100}]},
            "work_dir": str(self.tmp / "work"),
        }

    def release(self, max_batch_size: int, *, checkpoint: Path | None = None,
                served: dict | None = None) -> tuple[str, Path]:
        """Release in this process (Prefect's test harness); returns the version and the spec file promote reads."""
        data = self.spec(max_batch_size, checkpoint=checkpoint, served=served)
        state = release_flow(parse_spec(data), return_state=True)
        assert state.is_completed(), state.message
        done: ReleaseResult = state.result()
        path = self.tmp / f"spec-b{max_batch_size}.yaml"
        path.write_text(yaml.safe_dump(data))
        self.released.append(done.published.version)
        return done.published.version, path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, mlflow_server, prefect_harness) -> Iterator[Setup]:
    from prefect.settings import PREFECT_API_URL

    tmp = tmp_path_factory.mktemp("browser")
    repository = init_repository(tmp / "triton" / "repository")
    triton = start_triton(repository, log_path=repository.parent / "triton.log")
    # promote's flow run uses the harness's Prefect API, instead of starting a temporary one (~15 s)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    try:
        yield Setup(tmp, make_tiny_model(tmp / "hf", seed=0), mlflow_server.tracking_uri,
                    f"tiny-browser-{uuid.uuid4().hex[:6]}", triton.http_url, repository, env)
    finally:
        triton.stop()


# -- the tests (in order: version 1 approved, version 2 rejected, version 2's report) ----------------------


def test_approve_in_the_browser_and_promote_finishes(setup: Setup, browser) -> None:
    version, spec_path = setup.release(max_batch_size=4)
    promote = Promote.start(spec_path, version, setup.promote_env)
    try:
        with evidence(browser, "approve", promote):
            link = promote.link()
            assert link == mr.version_ui_url(setup.tracking_uri, setup.model, version)
            browser.get(link)
            page = description_text(browser, "Gates passed.")
            assert "Approving makes it the first live version of this model." in page
            # the link opens MLflow's model-training view, whose sidebar has the registry (its GenAI view has not)
            assert browser.find_elements(By.XPATH, "//a[normalize-space()='Model registry']")
            assert "Gates: validation passed, performance passed" in page
            assert re.search(r"^validation top-1 agreement \(teacher-forced\) [\d.]+ >= 0\.99\d*$", page, re.MULTILINE), page
            assert "\nvalidation prompts diverged from HF 0 of 4 <= 0\n" in page, page
            add_tag_in_ui(browser, "approved_by", "dana")
            add_tag_in_ui(browser, "approval", "approved")
            code = promote.finish()
            assert code == 0, promote.output()
            assert f"{setup.model} version {version} approved by dana" in promote.output()
    finally:
        promote.stop()
    assert mr.get_version_by_alias(setup.tracking_uri, setup.model, mr.ALIAS_PRODUCTION) == version
    assert router_weights(setup.repository, setup.model) == {int(version): 100}


def test_reject_in_the_browser_and_nothing_changes(setup: Setup, browser) -> None:
    live = mr.get_version_by_alias(setup.tracking_uri, setup.model, mr.ALIAS_PRODUCTION)
    assert live is not None, "needs the version approved by the test before"
    # version 2 serves other sampling defaults (generation_config.json), an intended change its spec accepts
    changed = shutil.copytree(setup.checkpoint, setup.tmp / "hf-new-defaults")
    generation = json.loads((changed / "generation_config.json").read_text())
    (changed / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.7, "top_p": 0.9}))
    why = "chat clients get sampling by default"
    version, spec_path = setup.release(max_batch_size=8, checkpoint=changed,
                                       served={"accept": {"generation_defaults": why}})
    promote = Promote.start(spec_path, version, setup.promote_env)
    try:
        with evidence(browser, "reject", promote):
            browser.get(promote.link())
            page = description_text(browser, "Gates passed.")
            assert f"Approving promotes it in place of version {live} (alias production)." in page, page
            assert f"Against version {live}, which it would replace" in page, page
            assert f"figure this version version {live} change" in page, page
            assert re.search(r"^top-1 agreement ([\d.]+) \1 same$", page, re.MULTILINE), page
            assert re.search(r"^output tokens/s [\d.]+ [\d.]+ (same|[\d.]+x, (better|worse))$", page, re.MULTILINE), page
            # each statistical gate: figure [interval]: verdict, budget; n (what 90% power needs) and what it detects
            power = r"; n (\d+) \(90% power needs (\d+)\), detects "
            for row in ((rf"fixed evaluation perplexity change vs production \+0\.00% \[\+0\.00%, \+0\.00%\]: within "
                        rf"<= \+5\.00%{power}\+[\d.]+%"),
                        (rf"fixed evaluation cloze accuracy drop \(points\) vs production \+0\.0 pt \[\+0\.0 pt, \+0\.0 pt\]: "
                        rf"within <= \+20\.0 pt{power}\+[\d.]+ pt"),
                        (rf"fixed evaluation mean KL from production to candidate, nats/token vs production 0 \[0, 0\]: "
                        rf"within <= 0\.05{power}[\d.e-]+"),
                        (rf"fixed evaluation greedy disagreement with production \(8 tokens, 3 prompts a passage\) vs "
                         rf"production 0 \[0, 0\]: within <= 0\.2{power}[\d.e-]+")):
                found = re.search(f"^{row}$", page, re.MULTILINE)
                assert found and int(found[1]) >= int(found[2]), (row, page)
            ab = re.search(rf"^performance throughput / production v{live} \(same run\) ([\d.]+) \[([\d.]+), ([\d.]+)\]: "
                           r"within >= 0\.05; \d+ rounds \(90% power needs \d+\); passes >= [\d.]+x with 90% power$",
                           page, re.MULTILINE)
            assert ab and float(ab[2]) <= float(ab[1]) <= float(ab[3]), page  # the A/B's interval holds its figure
            # the served configuration against production: the one part that differs, both sides and the verdict
            assert "Served configuration vs production" in page, page
            assert f"Against production version {live}: 1 part(s) differ." in page, page
            before = json.dumps({k: v for k, v in sorted(generation.items()) if k not in IGNORED_GENERATION_KEYS},
                                sort_keys=True)
            after = json.dumps({k: v for k, v in sorted({**generation, "temperature": 0.7, "top_p": 0.9}.items())
                                if k not in IGNORED_GENERATION_KEYS}, sort_keys=True)
            row = f"generation_defaults {before} {after} accepted: {why}"
            assert re.search(f"^{re.escape(row)}$", page, re.MULTILINE), (row, page)
            add_tag_in_ui(browser, "rejected_by", "erin")
            add_tag_in_ui(browser, "approval", "rejected")
            code = promote.finish()
            assert code == EXIT_GATE, promote.output()
            assert (f"promote stopped: {setup.model} version {version} was rejected in MLflow by erin: nothing was "
                    f"staged or changed in Triton; version {live} stays live (alias `production`); the alias "
                    f"`candidate` no longer points at version {version}") in promote.output()
    finally:
        promote.stop()
    assert router_weights(setup.repository, setup.model) == {int(live): 100}
    assert mr.get_version_by_alias(setup.tracking_uri, setup.model, mr.ALIAS_CANDIDATE) is None


def test_the_report_renders_with_its_plots_in_the_artifact_viewer(setup: Setup, browser) -> None:
    assert len(setup.released) == 2, "needs the two versions the tests before released"
    first, version = setup.released
    with evidence(browser, "report"):
        browser.get(mr.version_ui_url(setup.tracking_uri, setup.model, version))
        description_text(browser, "Gates passed.")
        tabs = set(browser.window_handles)
        browser.find_element(By.LINK_TEXT, "release report (gates, comparison, plots)").click()
        wait(browser).until(lambda d: len(d.window_handles) > len(tabs))  # MLflow opens page links in a new tab
        browser.switch_to.window((set(browser.window_handles) - tabs).pop())
        assert "/artifacts/report/release-report.html" in browser.current_url
        preview = wait(browser).until(ec.presence_of_element_located((By.TAG_NAME, "iframe")))
        browser.switch_to.frame(preview)
        heading = wait(browser).until(ec.presence_of_element_located((By.TAG_NAME, "h1")))
        assert heading.text.startswith(f"Release report: {setup.model}")
        assert f"Candidate against production (version {first}, speed and fixed evaluation measured in this run)" in browser.find_element(By.TAG_NAME, "body").text
        back = browser.find_element(By.XPATH, "//li[starts-with(normalize-space(), 'approve here:')]/a")
        assert back.get_attribute("href") == mr.version_ui_url(setup.tracking_uri, setup.model, version)

        def decoded_plots(driver) -> list[str]:
            return driver.execute_script(
                "return [...document.images].filter(i => i.complete && i.naturalWidth > 0).map(i => i.alt)")

        plots = wait(browser).until(lambda d: (found := decoded_plots(d)) and len(found) >= 2 and found)
        assert {"latency distributions", "validation divergence"} <= set(plots), plots
