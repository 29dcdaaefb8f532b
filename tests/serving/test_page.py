"""The page at `/`, driven in headless Chromium (Debian's chromium and chromedriver, through selenium): a
reviewer drops an image and sees the champion's and the challenger's top-k side by side, thumbnails with
labels and scores, each result that the other model does not return marked. Skipped where no Chromium is
installed, failed in CI (`.ci/run` installs it); the screenshot is what docs/serving.md shows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from serving_support import local_source, running

from xbn.config import ServeConfig
from xbn.serving.http import create_app

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser():
    """Headless Chromium; skipped without it, except in CI (CI=true: `.ci/run` installs it, so it must be there)."""
    if not (CHROMIUM and DRIVER):
        message = "needs Debian's chromium and chromium-driver"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI=true: the browser test must run)")
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_a_reviewer_sees_champion_and_challenger_side_by_side(versions, image_root, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    app = create_app(local_source(versions["a"]), ServeConfig(poll_interval_s=0), token=None,
                     challenger=local_source(versions["b"]), catalogue_root=image_root)
    with running(app) as client:
        browser.get(str(client.base_url) + "/")
        wait = WebDriverWait(browser, 30)
        wait.until(lambda d: "catalogue of 24 images" in d.find_element(By.ID, "about").text)
        assert "challenger: version" in browser.find_element(By.ID, "about").text
        browser.find_element(By.ID, "k").clear()
        browser.find_element(By.ID, "k").send_keys("6")
        upload = browser.find_element(By.ID, "file")
        browser.execute_script("arguments[0].hidden = false", upload)  # what a click on the drop zone opens
        upload.send_keys(str(image_root / "class3/img1.png"))
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("done", "error"))
        assert browser.find_element(By.ID, "error").text == ""

        columns = browser.find_elements(By.CSS_SELECTOR, ".column")
        assert [c.find_element(By.TAG_NAME, "h2").text.split(":")[0] for c in columns] == ["champion", "challenger"]
        answer = client.post("/compare", files={"image": ("q.png", (image_root / "class3/img1.png").read_bytes())},
                             data={"k": "6"}).json()
        for column, side in zip(columns, ("champion", "challenger")):
            figures = column.find_elements(By.TAG_NAME, "figure")
            expected = answer[side]["results"]
            assert [int(f.get_attribute("data-row")) for f in figures] == [r["row"] for r in expected]
            first = figures[0].find_element(By.TAG_NAME, "figcaption").text
            assert first.startswith(f"#1 {expected[0]['label']} (")
            # Every thumbnail loaded (a blob fetched with the page's credentials), none broken.
            assert all(browser.execute_script("return arguments[0].naturalWidth", f.find_element(By.TAG_NAME, "img"))
                       > 0 for f in figures)
        other = {side: {r["row"] for r in answer[side]["results"]} for side in ("champion", "challenger")}
        marked = {int(f.get_attribute("data-row")) for f in columns[0].find_elements(By.CSS_SELECTOR, "figure.changed")}
        assert marked == other["champion"] - other["challenger"]

        shot = tmp_path / "search_page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if target := os.environ.get("XBN_SCREENSHOT_DIR"):  # how docs/images/search_page.png was made
            shutil.copy(shot, Path(target) / shot.name)


def test_the_page_is_served_without_the_token_and_the_api_is_not(versions, image_root):  # noqa: F811
    app = create_app(local_source(versions["a"]), ServeConfig(poll_interval_s=0), token="s3cret",
                     catalogue_root=image_root)
    with running(app) as client:
        page = client.get("/")
        assert page.status_code == 200 and "<title>xbn search</title>" in page.text
        assert client.get("/catalogue/0").status_code == 401
        assert client.get("/catalogue/0", headers={"Authorization": "Bearer s3cret"}).headers["content-type"] \
            .startswith("image/")
        assert client.get("/catalogue/999", headers={"Authorization": "Bearer s3cret"}).status_code == 404
        missing = client.post("/compare", headers={"Authorization": "Bearer s3cret"},
                              files={"image": ("q.png", (image_root / "class0/img0.png").read_bytes())})
        assert missing.status_code == 404 and "no challenger" in missing.json()["detail"]
