# Runs inside the image's chroot (mmdebstrap --customize-hook), /bin/sh -eu.
# Services the testbed needs at boot; the roles configure the rest over SSH.
systemctl enable systemd-networkd.service kvlab-guest-init.service ssh.service
systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_reap.service \
    e2scrub_all.timer fstrim.timer modprobe@drm.service modprobe@efi_pstore.service \
    serial-getty@ttyS0.service getty@tty1.service
passwd --lock root
: > /etc/resolv.conf
# initramfs-tools honours SOURCE_DATE_EPOCH: the initrd is reproducible.
update-initramfs -u -k all
# Byte-code for the whole Python tree, hash-checked rather than timestamped so that it does not
# depend on file times: Ansible's modules start in seconds instead of minutes under TCG.
python3 -m compileall -q -f -j 1 --invalidation-mode unchecked-hash /usr/lib/python3.13 /usr/lib/python3/dist-packages >/dev/null
