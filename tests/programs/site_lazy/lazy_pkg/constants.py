import os

OFFLINE = os.environ.get("LAZY_PKG_OFFLINE", "0") == "1"
