// The login page: `agentenv view` prints a URL whose fragment holds the token (a fragment never reaches a server
// or its logs); it is put in the form, taken off the address bar and sent.
"use strict";

function loginFromFragment() {
  const given = new URLSearchParams(window.location.hash.slice(1)).get("token");
  if (!given) return;
  window.history.replaceState(null, "", window.location.pathname);
  document.getElementById("token").value = given;
  document.getElementById("submit").click();  // (the form's submit() is shadowed by its button, id "submit")
}

document.addEventListener("DOMContentLoaded", loginFromFragment);
window.addEventListener("hashchange", loginFromFragment);  // the URL opened over this very page
