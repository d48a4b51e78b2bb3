"""The API's reference pages, /docs (Swagger UI) and /redoc, served with no network.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so without internet they are blank.
Here their scripts and styles come from the pinned `fastapi-offline` package (MIT; it ships
Swagger UI's and ReDoc's released files), served by the app under DOCS_ASSETS; nothing on
either page asks another host for anything (no Google fonts, no online spec validator, no
Redocly logo).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

DOCS_PATH = "/docs"
REDOC_PATH = "/redoc"
DOCS_ASSETS = "/docs/assets"
REDOC_SCRIPT = "redoc.standalone.js"
REDOCLY_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


def assets_dir() -> Path:
    """Where the installed `fastapi-offline` keeps Swagger UI's and ReDoc's files."""
    return Path(str(files("fastapi_offline") / "static"))


def add_docs_pages(app: FastAPI) -> None:
    """Serve /docs and /redoc for `app`'s OpenAPI schema, their assets from this app. The app
    must be built with `docs_url=None, redoc_url=None` (FastAPI's CDN pages off)."""
    if app.openapi_url is None:
        raise ValueError("the app has no OpenAPI schema to show")
    openapi_url = app.openapi_url
    redoc_script: list[bytes] = []  # read once, on first use

    # Before the mount, so that it wins: ReDoc's script, less the one file it fetches from
    # another host (Redocly's logo; an empty image instead, which ReDoc then hides).
    @app.get(f"{DOCS_ASSETS}/{REDOC_SCRIPT}", include_in_schema=False)
    async def redoc_js() -> Response:
        if not redoc_script:
            text = (assets_dir() / REDOC_SCRIPT).read_bytes()
            redoc_script.append(text.replace(REDOCLY_LOGO, b"data:,"))
        return Response(redoc_script[0], media_type="text/javascript")

    app.mount(DOCS_ASSETS, StaticFiles(directory=assets_dir()), name="docs-assets")

    def page(request: Request) -> tuple[str, str, str]:
        """The schema's URL, the pages' title and where the assets are, under any root path."""
        root = request.scope.get("root_path", "")
        return f"{root}{openapi_url}", f"{app.title}: API", f"{root}{DOCS_ASSETS}"

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        schema, title, assets = page(request)
        return get_swagger_ui_html(
            openapi_url=schema, title=title, swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css", swagger_favicon_url=f"{assets}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},  # Swagger UI would ask validator.swagger.io
        )  # fmt: skip

    @app.get(REDOC_PATH, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        schema, title, assets = page(request)
        return get_redoc_html(openapi_url=schema, title=title, redoc_js_url=f"{assets}/{REDOC_SCRIPT}",
                              redoc_favicon_url=f"{assets}/favicon.png", with_google_fonts=False)  # fmt: skip
