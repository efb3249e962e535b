"""The release listing: per SKU of a model, its registered versions and which alias holds which."""

from __future__ import annotations

from datetime import datetime, timezone

from pipeline.project.config import Registry
from pipeline.tracking.client import TAG_DIGEST, TAG_MODEL, TAG_SKU, Tracking, connect
from pipeline.tracking.promotion import history
from pipeline.tracking.reports import ReleaseListing, SkuRelease, VersionRow


def _registered_models(tracking: Tracking, prefix: str, model: str) -> list:
    client = tracking.client
    out, token = [], None
    while True:
        # '_' is a LIKE wildcard: the tag check below keeps only this model's entries
        page = tracking.call(
            f"search registered models of {model}",
            client.search_registered_models,
            filter_string=f"name LIKE '{prefix}{model}.%'",
            max_results=100,
            page_token=token,
        )
        out += [rm for rm in page if (rm.tags or {}).get(TAG_MODEL) == model]
        token = page.token
        if not token:
            return out


def list_releases(
    registry: Registry, model: str, tracking: Tracking | None = None, with_history: bool = False
) -> ReleaseListing:
    registry.model(model)
    tracking = tracking or connect(registry)
    release = registry.release
    skus = []
    for rm in _registered_models(tracking, release.name_prefix, model):
        aliases = {a: str(v) for a, v in (rm.aliases or {}).items()}
        versions = tracking.call(
            f"search versions of {rm.name}", tracking.client.search_model_versions, f"name = '{rm.name}'"
        )
        rows = []
        for v in sorted(versions, key=lambda v: -int(v.version)):
            tags = v.tags or {}
            p50 = tags.get("skuforge.p50_ms")
            rows.append(
                VersionRow(
                    version=str(v.version),
                    digest=tags.get(TAG_DIGEST),
                    run_id=v.run_id,
                    created=datetime.fromtimestamp(v.creation_timestamp / 1000, timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    aliases=sorted(a for a, n in aliases.items() if n == str(v.version)),
                    correctness=tags.get("skuforge.correctness"),
                    p50_ms=float(p50) if p50 else None,
                    git_commit=tags.get("skuforge.git_commit"),
                )
            )
        skus.append(
            SkuRelease(
                sku=(rm.tags or {}).get(TAG_SKU, rm.name),
                registered_model=rm.name,
                aliases=aliases,
                versions=rows,
                history={a: history(rm, a) for a in release.aliases} if with_history else {},
            )
        )
    skus.sort(key=lambda s: s.sku)
    required = [s for _, s in registry.pairs(models=[model], skus=registry.release_skus())]
    published = {s.sku for s in skus if s.versions}
    return ReleaseListing(
        model=model,
        tracking_uri=tracking.display,
        chain=list(release.aliases),
        required_skus=required,
        skus=skus,
        missing=[s for s in required if s not in published],
    )
