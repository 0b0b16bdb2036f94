"""attest/verify's command line: its options and their help (docs/verify.md)."""

import argparse

TIMEOUT_SECONDS = 30


class UsageError(Exception):
    """Bad usage: attest/verify says why on stderr, ends with its verdict line, and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse, except that an error is raised to attest/verify's main, which ends every run
    with a verdict (or its --json document), instead of leaving from inside the parser."""

    def error(self, message):
        raise UsageError(message)


def parser():
    p = Parser(
        prog="attest/verify",
        description="Check a running tinygw against its release and a policy (docs/verify.md).",
        epilog="exit status: 0 every check PASSed, 1 a "
        "check FAILed or the run timed out, 2 bad usage or a local I/O error, 4 unverified "
        "(a check was SKIPped)",
    )
    expected = p.add_mutually_exclusive_group(required=True)
    expected.add_argument("--release", help="release.json of the build to expect")
    expected.add_argument("--artifact", help="the artifact to expect (hashed here)")
    expected.add_argument("--quote", help="check only this saved quote (its signature; with --policy, the TD too)")
    expected.add_argument(
        "--snp-report", metavar="FILE", help="check only this saved SEV-SNP report (raw or hex), with --vcek and --ask"
    )
    _snp_options(p)
    p.add_argument(
        "--url",
        action="append",
        help="the gateway, e.g. https://127.0.0.1:8080; given more than once, replicas of one service: each is "
        "verified, then all must bind the same HPKE key configuration and receipt key",
    )
    p.add_argument(
        "gateway", nargs="?", metavar="URL", help="the gateway, as --url: attest/verify https://HOST:PORT/ ..."
    )
    p.add_argument("--config-sha256", help="the configuration hash to expect (tinygw check prints it)")
    p.add_argument(
        "--policy",
        metavar="FILE",
        help="a policy file (JSON): the allowed values of mrtd, rtmr0-2, "
        "mrseam, xfam, td_attributes, fmspc, platform_ids, tcb, min_tcb_evaluation_data_number, snp",
    )
    p.add_argument(
        "--learn-policy",
        metavar="FILE",
        help="write the policy this evidence satisfies, once every "
        "check PASSed (the signature included): review it, then pin it with --policy",
    )
    _quote_options(p)
    _output_options(p)
    return p


def _snp_options(p):
    """SEV-SNP's certificates, in place of the host's."""
    p.add_argument(
        "--vcek",
        metavar="FILE",
        help="SEV-SNP: the VCEK (PEM or DER) for the report's chip and TCB, in place of the host's",
    )
    p.add_argument("--ask", metavar="FILE", help="SEV-SNP: AMD's ASK (PEM or DER), in place of the host's")
    p.add_argument(
        "--ark",
        metavar="FILE",
        help="SEV-SNP: an ARK, which must be one of the pinned (default: the built-in one that issued the ASK)",
    )
    p.add_argument(
        "--snp-crl",
        metavar="FILE",
        help="SEV-SNP: AMD's revocation list for the product (KDS /vcek/v1/PRODUCT/crl, DER or PEM), signed by "
        "the ARK: certificate chain then FAILs a revoked ASK or VCEK (without it, the PASS says revocation was "
        "not checked)",
    )


def _quote_options(p):
    """How a TDX quote's signature is checked, and the TD's MRTD."""
    collateral = p.add_mutually_exclusive_group()
    collateral.add_argument("--collateral", help="Intel DCAP collateral of the quote (JSON, as dcap-qvl reads it)")
    collateral.add_argument("--pccs", help="a PCCS or Intel PCS URL to fetch the quote's collateral from")
    p.add_argument(
        "--accept-tcb",
        help='TCB statuses to accept besides UpToDate (a policy\'s "tcb" in short), e.g. SWHardeningNeeded',
    )
    p.add_argument(
        "--now",
        type=int,
        help="judge the collateral, the TCB grace, an SEV-SNP chain and its CRL at this Unix time (default: now)",
    )
    p.add_argument(
        "--platform-verifier",
        help="another command that checks a quote's signature; the quote's "
        "path is appended; used without --collateral/--pccs",
    )
    p.add_argument("--expect-mrtd", help="the TD image's MRTD to expect (hex; a policy's \"mrtd\" in short)")


def _output_options(p):
    """What is written, printed and bounded; what a SKIP does."""
    p.add_argument(
        "--save-cert", metavar="FILE", help="write the attested TLS certificate here, only when every check PASSed"
    )
    p.add_argument(
        "--save-hpke",
        metavar="FILE",
        help="write the attested EHBP key configuration here (application/ohttp-keys), only when every check PASSed",
    )
    p.add_argument(
        "--save-attestation",
        metavar="FILE",
        help="write the /attestation answer here with the record of this run, only when every check PASSed "
        "(for `receipt --attestation`, which trusts no other)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the checks as one JSON document (name, result, reason, values) instead of lines",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"bound on the whole run: connect, TLS, request, answer, collateral (default {TIMEOUT_SECONDS})",
    )
    p.add_argument("--allow-no-evidence", action="store_true", help="SKIP, not FAIL, the quote checks without hardware")
    p.add_argument(
        "--accept-unverified",
        action="store_true",
        help="exit 0, not 4, when checks were SKIPped "
        "(the last line then says UNVERIFIED); never saves a certificate or a policy",
    )
