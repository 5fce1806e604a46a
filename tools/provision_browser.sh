#!/usr/bin/env bash
# The browser test's Chromium (tests/test_dashboard_browser.py): Debian's chromium and chromium-driver, installed
# only when one of them is missing and this runs as root with apt-get; otherwise it does nothing. One line of output.
set -u
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "provision_browser: no chromium here and no root apt-get to install it; the browser test will skip"
    exit 0
fi
log="${TMPDIR:-/tmp}/provision_browser.$$.log"
if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver; } >"$log" 2>&1; then
    echo "provision_browser: installed Debian's chromium and chromium-driver"
    rm -f "$log"
else
    echo "provision_browser: apt-get could not install chromium (see $log); the browser test will skip"
fi
exit 0
