/*
 * A matrix set's expression checked as it is typed (templates/admin/scheduling/matrixset/
 * change_form.html): the name, expression and position go to the admin's check view
 * (MatrixSetAdmin.check_view in scheduling/admin_routing.py), which compiles the whole matrix
 * with them; its error, or the combinations the set allows, is shown under the field. The save
 * runs the same check, so the page never promises what the save refuses.
 *
 * Model ids are user-controlled: everything is written with textContent, never innerHTML.
 * No framework, no CDN (the proxy runs on offline boxes).
 */
(function () {
  "use strict";

  var DEBOUNCE_MS = 250;

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (name) { node.setAttribute(name, attrs[name]); });
    if (text !== undefined) {
      node.textContent = text;
    }
    return node;
  }

  function render(box, answer) {
    box.replaceChildren();
    box.className = answer.ok ? "dsl-ok" : "dsl-bad";
    if (!answer.ok) {
      box.appendChild(el("p", { "class": "dsl-error", "data-testid": "dsl-error" },
                          answer.error));
      return;
    }
    box.appendChild(el("p", {}, "Allows these models together (and any subset of one):"));
    var list = el("ul", { "data-testid": "dsl-combinations" });
    answer.combinations.forEach(function (combo) {
      var item = el("li");
      item.appendChild(el("code", {}, combo.join(" & ")));
      list.appendChild(item);
    });
    box.appendChild(list);
    if (answer.truncated) {
      box.appendChild(el("p", { "class": "help" }, "… and more."));
    }
    if (answer.note) {
      box.appendChild(el("p", { "class": "help" }, answer.note));
    }
  }

  document.addEventListener("DOMContentLoaded", function () {
    var box = document.getElementById("dsl-check");
    var dsl = document.getElementById("id_dsl");
    if (!box || !dsl) {
      return;
    }
    var form = dsl.form;
    var name = document.getElementById("id_name");
    var position = document.getElementById("id_position");
    // under the field, where the eye is while typing
    var row = dsl.closest(".form-row") || dsl.parentNode;
    row.appendChild(box);

    var timer = null;
    var sent = 0; // the latest request's number: an older answer arriving late is dropped

    function check() {
      var number = ++sent;
      var body = new FormData();
      body.append("name", name ? name.value : "");
      body.append("dsl", dsl.value);
      body.append("position", position ? position.value : "0");
      body.append("pk", box.dataset.pk || "");
      var token = form.querySelector("input[name=csrfmiddlewaretoken]");
      fetch(box.dataset.url, {
        method: "POST", body: body, credentials: "same-origin",
        headers: { "X-CSRFToken": token ? token.value : "" },
      }).then(function (response) {
        return response.json().then(function (answer) {
          if (!response.ok) {
            answer = { ok: false, error: (answer.error || {}).message || response.statusText };
          }
          return answer;
        });
      }).then(function (answer) {
        if (number === sent) {
          render(box, answer);
        }
      }).catch(function (error) {
        if (number === sent) {
          render(box, { ok: false, error: "could not check the expression: " + error });
        }
      });
    }

    function later() {
      clearTimeout(timer);
      timer = setTimeout(check, DEBOUNCE_MS);
    }

    [dsl, name, position].forEach(function (field) {
      if (field) {
        field.addEventListener("input", later);
      }
    });
    if (dsl.value.trim() && !box.children.length) {
      check(); // a page shown again with errors: check what is typed there
    }
  });
})();
