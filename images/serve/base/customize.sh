# Runs in the base rootfs (chroot) after the packages are unpacked.
# The interpreter's own byte-code, without file times: the image is read-only at run time.
python3 -m compileall -q --invalidation-mode unchecked-hash /usr/lib/python3.11 >/dev/null || true
