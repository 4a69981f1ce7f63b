"""Maps the top-level folders onto the `peerflow` import names.

`core/` is `peerflow`; `plugins/`, `adapters/`, `contrib/` and `conformance/` are its
sub-packages. Every package is listed explicitly so wheel and editable installs agree.
"""

from setuptools import find_packages, setup

ROOTS = {
    "peerflow": "core",
    "peerflow.plugins": "plugins",
    "peerflow.adapters": "adapters",
    "peerflow.contrib": "contrib",
    "peerflow.conformance": "conformance",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for package, folder in ROOTS.items():
    package_dir[package] = folder
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
