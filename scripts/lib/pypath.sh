# shellcheck shell=bash
# Puts the folders where pip installs scripts (componentize-py) on PATH: a
# `pip install --user` on a machine whose Python is protected lands in
# ~/.local/bin, which a fresh shell may not have on PATH. tests/build.rs runs
# componentize-py from PATH, so every cargo command that builds the tests
# crate (test, clippy) needs it.
while read -r _pydir; do
    case ":$PATH:" in *":$_pydir:"*) ;; *) PATH="$PATH:$_pydir" ;; esac
done < <(python3 -c 'import site, sysconfig; print(sysconfig.get_path("scripts")); print(site.getuserbase() + "/bin")')
unset _pydir
export PATH
