# Runs inside the appliance's chroot (mmdebstrap --customize-hook), /bin/sh -eu, with
# KVLAB_KVER, KVLAB_INITRD_MODULES and KVLAB_INITRD_DRIVERS set by the builder.
# Boot units: the seed's validator and export; SSH only when the seed asks for it.
systemctl enable systemd-networkd.service kvlab-seed-validate.service kvlab-nvmet-export.service \
    kvlab-seed-ssh.service
systemctl disable ssh.service
# efi.automount: systemd-gpt-auto-generator makes it for the ESP that the UKI's stub reports, and
# it fails at boot (nothing on the appliance reads the ESP once booted)
systemctl mask e2scrub_reap.service e2scrub_all.timer fstrim.timer serial-getty@ttyS0.service \
    getty@tty1.service systemd-firstboot.service efi.automount
passwd --lock root
rm -f /etc/resolv.conf
# The initrd: dracut's systemd initrd with systemd-veritysetup (initramfs-tools cannot open a
# verity root); --reproducible and SOURCE_DATE_EPOCH give the same bytes each build.
rm -f /boot/initrd.img-*
dracut --quiet --force --reproducible --no-hostonly --no-hostonly-cmdline --no-early-microcode \
    --kver "$KVLAB_KVER" --modules "$KVLAB_INITRD_MODULES" --drivers "$KVLAB_INITRD_DRIVERS" \
    --compress gzip "/boot/initrd.img-$KVLAB_KVER"
# Byte-code checked by hash, not by file time: the root is read-only, Python cannot write it later.
python3 -m compileall -q -f -j 1 --invalidation-mode unchecked-hash /usr/lib/python3.13 /usr/lib/python3/dist-packages >/dev/null
