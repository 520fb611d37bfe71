"""Build torchmp's one private extension, torchmp._core, from csrc/.

Knobs (environment variables):
  TORCHMP_DEBUG=1     -O0 -g, assertions on, Cython line tracing
  TORCHMP_ANNOTATE=1  write Cython's HTML annotation next to the .pyx
  TORCHMP_PORTABLE=1  build without epoll, pidfd, eventfd, prctl, close_range
                      and vfork: the paths other POSIX systems take
  TORCHMP_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer
  TORCHMP_COVERAGE=1  gcov line counters (-O0), for .ci/coverage

There is no pure-Python fallback: if the extension cannot be built, the
install fails.
"""
import os
import platform
import re
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError

try:
    from Cython.Build import cythonize
except ImportError:  # pragma: no cover - build-system requires Cython
    sys.exit("torchmp: building needs Cython >= 3 (pip install Cython)")

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def _version():
    # Read, not imported: torchmp/__init__.py imports the core being built.
    with open(os.path.join(HERE, "torchmp", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not match:
        raise RuntimeError("torchmp/__init__.py has no __version__")
    return match.group(1)


VERSION = _version()
DEBUG = _flag("TORCHMP_DEBUG")
PORTABLE = _flag("TORCHMP_PORTABLE")
SANITIZE = _flag("TORCHMP_SANITIZE")
COVERAGE = _flag("TORCHMP_COVERAGE")

define_macros = [("TORCHMP_VERSION", '"%s"' % VERSION)]
undef_macros = []
compile_args = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
link_args = []
directives = {"language_level": 3, "embedsignature": True}

if DEBUG:
    compile_args += ["-O0", "-g3"]
    undef_macros.append("NDEBUG")
    define_macros.append(("CYTHON_TRACE_NOGIL", "1"))
    directives["linetrace"] = True
else:
    compile_args += ["-O2"]
if PORTABLE:
    define_macros.append(("TORCHMP_PORTABLE", "1"))
if SANITIZE:
    compile_args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    link_args += ["-fsanitize=address,undefined"]
if COVERAGE:
    # -fno-builtin-execve: gcc would otherwise route execve through a wrapper
    # that writes the counters and marks them written, which from a vfork
    # child (sharing the launcher's memory) stops the launcher's own counters
    # from ever being written.  Atomic updates: the I/O thread counts too.
    compile_args += ["--coverage", "-O0", "-fno-builtin-execve", "-fprofile-update=prefer-atomic"]
    link_args += ["--coverage"]
    define_macros.append(("TORCHMP_COVERAGE", "1"))

C_SOURCES = [
    "csrc/spawn.c", "csrc/framer.c", "csrc/console.c", "csrc/console_target.c", "csrc/poller.c",
    "csrc/loop_streams.c", "csrc/loop_follow.c", "csrc/loop_feeds.c", "csrc/loop_consoles.c", "csrc/loop_reap.c",
    "csrc/loop_groups.c", "csrc/loop_thread.c", "csrc/loop_commands.c", "csrc/command.c", "csrc/notifier.c",
    "csrc/keeper.c", "csrc/keeper_watch.c", "csrc/procscan.c", "csrc/bind.c",
    "csrc/cgroupfs.c",
]
# torchmp/_keeper, the program the keeper is exec'd from (csrc/keeper.c says
# why).  Linux only: elsewhere, and in the portable build, the launcher forks
# its keeper.
KEEPER_SOURCES = ["csrc/keeper_main.c", "csrc/keeper_watch.c"]
BUILD_KEEPER = sys.platform.startswith("linux") and not PORTABLE
# On x86-64 without a C library (csrc/keeper_sys.h): a launcher's first
# launch waits for the program's start, which the dynamic loader made ~0.6 ms
# longer.  Not under the sanitizers or gcov, which need their runtimes.
KEEPER_WITHOUT_LIBC = BUILD_KEEPER and platform.machine() in ("x86_64", "AMD64") and not (SANITIZE or COVERAGE)
KEEPER_WITHOUT_LIBC_FLAGS = {
    "compile": ["-DTORCHMP_KEEPER_FREESTANDING=1", "-ffreestanding", "-fno-stack-protector", "-fno-builtin",
                "-fno-pie", "-fno-asynchronous-unwind-tables"],
    "link": ["-nostdlib", "-nostartfiles", "-static", "-no-pie"],
}
if KEEPER_WITHOUT_LIBC:
    define_macros.append(("TORCHMP_KEEPER_WITHOUT_LIBC", "1"))


class BuildExtAndKeeper(build_ext):
    """build_ext, then torchmp/_keeper next to the built core (in place
    too), with the core's flags."""

    def run(self):
        super().run()
        if BUILD_KEEPER:
            self.build_keeper()

    def build_keeper(self):
        out_dir = os.path.dirname(self.get_ext_fullpath("torchmp._core"))
        target = os.path.join(out_dir, "_keeper")
        inputs = KEEPER_SOURCES + ["csrc/torchmp.h", "csrc/keeper_sys.h"]
        newest = max(os.path.getmtime(os.path.join(HERE, f)) for f in inputs)
        if not self.force and os.path.exists(target) and os.path.getmtime(target) >= newest:
            return
        if KEEPER_WITHOUT_LIBC:
            try:
                self._link_keeper(out_dir, "keeper-nolibc", compile_args + KEEPER_WITHOUT_LIBC_FLAGS["compile"],
                                  link_args + KEEPER_WITHOUT_LIBC_FLAGS["link"])
                return
            except (CompileError, LinkError) as e:
                # A tool chain that cannot: the C library's keeper works the
                # same, only its start is slower (tests/test_process_safety.py
                # says so in this project's CI).
                self.warn(f"torchmp/_keeper without a C library failed ({e}); building it with one")
        self._link_keeper(out_dir, "keeper", compile_args, link_args)

    def _link_keeper(self, out_dir, temp_name, compile_flags, link_flags):
        objects = self.compiler.compile(
            KEEPER_SOURCES, output_dir=os.path.join(self.build_temp, temp_name),
            macros=define_macros + [(m,) for m in undef_macros], include_dirs=["csrc"], extra_postargs=compile_flags)
        self.compiler.link_executable(objects, "_keeper", output_dir=out_dir, extra_postargs=link_flags)


extension = Extension(
    "torchmp._core",
    sources=["csrc/_core.pyx"] + C_SOURCES,
    include_dirs=["csrc"],
    define_macros=define_macros,
    undef_macros=undef_macros,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    depends=["csrc/torchmp.h", "csrc/keeper_sys.h", "csrc/command.h", "csrc/loop_internal.h", "csrc/console_internal.h",
             "csrc/ctorchmp.pxd", "csrc/signal_wake.pxi", "csrc/specs.pxi", "csrc/group.pxi", "csrc/fork.pxi",
             "csrc/command.pxi"]
    + C_SOURCES,
)

setup(
    version=VERSION,
    cmdclass={"build_ext": BuildExtAndKeeper},
    ext_modules=cythonize(
        [extension],
        compiler_directives=directives,
        annotate=_flag("TORCHMP_ANNOTATE"),
        include_path=["csrc"],
        force=DEBUG or PORTABLE or SANITIZE or COVERAGE,
    ),
)
