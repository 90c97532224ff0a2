#!/bin/sh
# Installs Debian's headless Chromium and its driver for the chat page's browser tests
# (tests/test_chat_page.py). Never fails the setup: where it cannot install, it says why and
# those tests skip with that reason.
have() { command -v "$1" >/dev/null 2>&1; }
browser() { have chromium || have chromium-browser || have google-chrome; }
driver() { have chromedriver || [ -x /usr/bin/chromedriver ]; }

if browser && driver; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_browser: chromium/chromedriver missing and not root; the browser tests will skip" \
         "(as root: apt-get install chromium chromium-driver)" >&2
    exit 0
fi
if ! have apt-get; then
    echo "install_browser: chromium/chromedriver missing and no apt-get here; the browser tests will skip" \
         "(install Chromium and its chromedriver with this system's package manager)" >&2
    exit 0
fi
echo "install_browser: installing chromium and chromium-driver from the system's packages" >&2
if ! (DEBIAN_FRONTEND=noninteractive apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver); then
    echo "install_browser: apt-get could not install chromium/chromium-driver (offline?);" \
         "the browser tests will skip" >&2
fi
exit 0
