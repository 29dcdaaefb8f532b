// The script of index.html (a file of its own: the page's Content-Security-Policy allows no inline script).
"use strict";
const $ = (id) => document.getElementById(id);
const tokenField = $("token");
tokenField.value = sessionStorage.getItem("xbn-token") || "";
tokenField.addEventListener("change", () => sessionStorage.setItem("xbn-token", tokenField.value));

function headers() {
  return tokenField.value ? { Authorization: "Bearer " + tokenField.value } : {};
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${path}: ${response.status} ${detail}`);
  }
  return response;
}

async function about() {
  const health = await (await fetch("/health")).json();
  if (health.status !== "ok") {
    $("about").textContent = "no model loaded yet: " + (health.error || "loading");
    return;
  }
  $("about").textContent = `${health.model} version ${health.version}` +
    (health.alias ? ` (@${health.alias})` : "") + `, catalogue of ${health.index_size} images` +
    (health.challenger ? `; challenger: version ${health.challenger.version}` : "");
  $("compare-label").hidden = !health.challenger;
  $("k").max = health.max_k || 100;
}

async function thumbnail(row) {
  // Fetched with the token (an <img src> could not send it), shown from a blob URL.
  const blob = await (await api(`/catalogue/${row}`)).blob();
  return URL.createObjectURL(blob);
}

async function column(title, answer, other) {
  const div = document.createElement("div");
  div.className = "column";
  div.innerHTML = `<h2></h2><div class="grid"></div>`;
  div.querySelector("h2").textContent = `${title}: version ${answer.version}`;
  const others = new Set((other || []).map((r) => r.row));
  for (const hit of answer.results) {
    const fig = document.createElement("figure");
    fig.dataset.row = hit.row;
    if (other && !others.has(hit.row)) fig.className = "changed";  // not in the other model's top-k
    const img = document.createElement("img");
    img.alt = hit.path;
    img.src = await thumbnail(hit.row);
    const caption = document.createElement("figcaption");
    caption.textContent = `#${hit.rank} ${hit.label} (${hit.score.toFixed(3)})`;
    fig.append(img, caption);
    div.querySelector(".grid").append(fig);
  }
  return div;
}

async function search(file) {
  $("error").textContent = "";
  $("results").replaceChildren();
  $("query").replaceChildren();
  const preview = document.createElement("img");
  preview.src = URL.createObjectURL(file);
  $("query").append(preview);
  const form = new FormData();
  form.append("image", file);
  form.append("k", $("k").value);
  try {
    const compare = !$("compare-label").hidden && $("compare").checked;
    const answer = await (await api(compare ? "/compare" : "/search", { method: "POST", body: form })).json();
    if (compare) {
      $("results").append(
        await column("champion", answer.champion, answer.challenger.results),
        await column("challenger", answer.challenger, answer.champion.results));
    } else {
      $("results").append(await column(answer.alias || "served", answer));
    }
    document.body.dataset.state = "done";
  } catch (error) {
    $("error").textContent = error.message;
    document.body.dataset.state = "error";
  }
}

const drop = $("drop");
drop.addEventListener("click", () => $("file").click());
$("file").addEventListener("change", (e) => e.target.files[0] && search(e.target.files[0]));
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  if (e.dataTransfer.files[0]) search(e.dataTransfer.files[0]);
});
about().catch((error) => { $("about").textContent = error.message; });
