"""Operations: ansible-runner wrapper, deploy and day-2 commands."""
