"""pytest plugin: adds the --wsync-* options and markers (placeholder until the suite lands)."""


def pytest_addoption(parser):
    group = parser.getgroup("wsync", "wsync conformance")
    group.addoption("--wsync-transport", default="inproc", help="transport name to test")
    group.addoption("--wsync-device", default="cpu", choices=["cpu", "cuda"], help="device of the models")
    group.addoption("--wsync-option", action="append", default=[], metavar="KEY=VALUE", help="transport option")
